"""Device and dtype choice: `--device auto` / `--dtype auto` and the one-line errors for devices
this machine does not have. Resolved before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from specbench.errors import SpecbenchError

# CPU flags (Linux /proc/cpuinfo) that mean native bf16 matrix arithmetic.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(spec: str | None) -> str:
    """'auto' -> 'cuda' when CUDA is available, else 'cpu'; 'cpu', 'cuda', 'cuda:N' are checked
    against this machine. Returns the device string to load on."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise SpecbenchError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise SpecbenchError(f"device {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise SpecbenchError(f"--device {spec}: CUDA is not available on this machine "
                             f"(torch {torch.__version__}); use --device cpu or auto")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise SpecbenchError(f"--device {spec}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return spec


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields in Linux's /proc/cpuinfo ('model name', 'cpu family', 'model', 'flags', ...);
    empty elsewhere. ``cpuinfo``: that file's text, read here when None."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip() and fields:
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> set[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    return set(cpu_fields().get("flags", "").split())


def emulated_bf16(device: str, flags: set[str] | None = None) -> bool:
    """True on a CPU without native bf16, where bf16 matrix products are emulated: 2-5x slower than fp32."""
    if torch.device(device).type != "cpu":
        return False
    flags = cpu_flags() if flags is None else flags
    return not any(f in flags for f in BF16_CPU_FLAGS)


def choose_dtype(spec: str, device: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype name, why). 'auto' is bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or
    AMX), else float32 (emulated bf16 is slower than fp32 there). An explicit dtype is kept."""
    if spec != "auto":
        return spec, "requested"
    if torch.device(device).type == "cuda":
        return "bfloat16", "cuda"
    flags = cpu_flags() if flags is None else flags
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if native:
        return "bfloat16", f"cpu has {native[0]}"
    return "float32", "cpu has no native bf16 (no avx512_bf16/amx_bf16)"
