"""The engine: one decode loop, the target, draft trees, lossless verification, the clock; and the baseline."""

VANILLA = "vanilla"  # the baseline's name (vanilla.py): the runner, export, orderings and report use this one
# The target every command uses unless told otherwise: SmolLM2-135M-Instruct, embedded as a GGUF wheel
# (target.py's _EMBEDDED). Torch-free here, so the command line's help can name it without loading torch.
DEFAULT_TARGET = "smollm2-135m"
# Requests the batched loop (batch_loop.py) decodes together at most: more is a typo on any machine we time.
MAX_BATCH = 256
