"""Training options are checked before the target loads: one ``SpecbenchError`` line per bad value."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from specbench.errors import SpecbenchError


def check_options(values: dict, then: Callable[[], None] | None = None) -> None:
    """``values``: option name -> value, already held to their declaration (``specbench.options.validate``);
    ``then``: a command's own checks. Then the files and names every command may take: dtype, data dir,
    prompt file (read now, so a damaged one fails before the target loads) and the output folder."""
    from specbench.engine.target import resolve_dtype

    if then is not None:
        then()
    if values.get("dtype", "auto") != "auto":
        resolve_dtype(values["dtype"])
    if values.get("data_dir"):
        from specbench.data.benchmarks import check_data_dir_option

        check_data_dir_option(values["data_dir"])
    if "prompts" in values:
        from specbench.data.benchmarks import load_benchmark

        load_benchmark(str(prompt_file(values["prompts"], values.get("data_dir"))), limit=values.get("limit"))
    out = values.get("out")
    if out is not None:
        check_writable_folder(Path(out))


def layer_numbers(value: str, flag: str, required: bool = False) -> list[int]:
    """Comma-separated layer numbers (>= 0); ``required``: at least one."""
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise SpecbenchError(f"{flag} expects comma-separated layer numbers (got {value!r}), e.g. 0,1") from None
    if any(i < 0 for i in ids) or (required and not ids):
        raise SpecbenchError(f"{flag} expects layer numbers >= 0 (got {value!r})")
    return ids


def check_writable_folder(out: Path) -> None:
    try:
        if out.exists() and not out.is_dir():
            raise SpecbenchError(f"--out {out} is a file; pass a folder to write the drafter to")
        existing = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    except OSError as exc:
        raise SpecbenchError(f"--out {out}: {exc.strerror}; pass another folder") from None
    if not os.access(existing, os.W_OK):
        raise SpecbenchError(f"--out {out}: {existing} is not writable; pass a writable folder")


def prompt_file(prompts: Optional[str], data_dir: Optional[str]) -> Path:
    from specbench.data.benchmarks import data_dir as resolve_dir
    from specbench.training.data import DEFAULT_PROMPTS

    if prompts:
        path = Path(prompts)
    else:
        folder = resolve_dir(data_dir)
        if folder is None:
            raise SpecbenchError("no prompt file: pass --prompts FILE.jsonl or set SPECBENCH_DATA to the data folder "
                                 f"holding {DEFAULT_PROMPTS}")
        path = Path(folder) / DEFAULT_PROMPTS
    if not path.is_file():
        raise SpecbenchError(f"prompt file {path} does not exist; pass --prompts FILE.jsonl")
    if not os.access(path, os.R_OK):
        raise SpecbenchError(f"prompt file {path} is not readable; check its permissions")
    return path
