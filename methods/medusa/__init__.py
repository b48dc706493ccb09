"""Medusa: ``drafter`` (the heads, their loss, the sparse tree and the registered drafter) and ``trainer``
(`specbench train medusa`)."""
