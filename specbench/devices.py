"""Turn a ``--device`` string into a torch.device, or one line saying what to pass instead."""

from __future__ import annotations

import torch

from specbench.errors import SpecbenchError


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' (checked against this machine), 'mps'; anything else is refused."""
    try:
        device = torch.device(name.strip())
    except (RuntimeError, ValueError):
        raise SpecbenchError(f"unknown device {name!r}; pass cpu or cuda (cuda:N for one GPU)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecbenchError(f"--device {name}: this machine has no CUDA GPU (or torch was built without CUDA); "
                                 "pass --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SpecbenchError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here; "
                                 "pass cuda:0 or cpu")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise SpecbenchError(f"--device {name}: MPS is not available here; pass --device cpu")
    elif device.type != "cpu":
        raise SpecbenchError(f"unsupported device {name!r}; pass cpu or cuda")
    return device
