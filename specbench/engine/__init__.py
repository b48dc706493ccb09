"""The engine: one decode loop, the target, draft trees, lossless verification, the clock; and the baseline."""
