"""specbench: a fair, lossless benchmark harness for speculative decoding."""
__version__ = "0.1.0"
