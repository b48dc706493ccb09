"""Adapters that run a method's reference implementation (its authors' own code) for `specbench parity`,
each registered under the entry-point group ``specbench.run.parity`` by the method it reproduces."""
