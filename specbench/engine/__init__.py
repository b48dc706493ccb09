"""The engine: one decode loop, the target, draft trees, lossless verification, the clock; and the baseline."""

VANILLA = "vanilla"  # the baseline's name (vanilla.py): the runner, export, orderings and report use this one
