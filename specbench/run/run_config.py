"""What one `specbench run` is: ``RunConfig``, whose fields are also the command's flags.

Each field that the command line sets is made with ``flag()``: its library default, its help text and,
where the command line differs from the library, the flag's spelling, its default (``auto`` where the
library picks a fixed value), its type and how the flag's value becomes the field's. `specbench run`
builds its Typer parameters from these fields (``run_flags``) and its RunConfig back from the parsed
flags (``config_values``), so a flag is declared once, here.

Kept free of torch so that `specbench --help` stays fast (the runner imports this module).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from specbench.engine import VANILLA as BASELINE

# The embedded default target (specbench.engine.target.DEFAULT_TARGET, which imports torch; a test
# checks they agree).
DEFAULT_TARGET = "smollm2-135m"

class _Same:
    """The command line uses the library's default / type."""

    def __repr__(self) -> str:
        return "SAME"


_SAME: Any = _Same()


@dataclass(frozen=True)
class Flag:
    """How `specbench run` spells one RunConfig field."""

    help: str
    names: tuple[str, ...] = ()  # e.g. ("--method", "-m"); empty: --field-name
    cli_default: Any = _SAME  # the command line's default where it differs from the library's
    cli_type: Any = _SAME  # the command line's type where it differs (a Path, key=value strings)
    convert: Optional[Callable[[Any], Any]] = None  # flag value -> field value


REQUIRED: Any = dataclasses.MISSING  # a field with no library default


def flag(default: Any, help: str, *names: str, cli_default: Any = _SAME, cli_type: Any = _SAME,
         convert: Optional[Callable[[Any], Any]] = None) -> Any:
    """A RunConfig field that `specbench run` sets from a flag (see the module docstring)."""
    metadata = {"flag": Flag(help, names, cli_default, cli_type, convert)}
    if default is REQUIRED:
        return field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _path_text(value: Optional[Path]) -> Optional[str]:
    return str(value) if value is not None else None


def _template_kwargs(items: list[str]) -> dict:
    from specbench.engine.prompts import parse_template_kwargs

    return parse_template_kwargs(list(items))


@dataclass
class RunConfig:
    # method and bench are required in code; on the command line --preset may stand in for them.
    method: str = flag(REQUIRED, "Method name (see `specbench list methods`).", "--method", "-m",
                       cli_default=None, cli_type=Optional[str])
    bench: str = flag(REQUIRED, "Benchmark name or a .jsonl file.", "--bench", "-b", cli_default=None,
                      cli_type=Optional[str])
    target: str = flag(DEFAULT_TARGET, "Target: smollm2-135m, a .gguf file, a model folder or a hub id "
                       "org/name or org/name@REVISION.")
    temperature: float = flag(0.0, "0 = greedy; > 0 samples (lossless either way).")
    top_k: int = flag(0, "Top-k filter at T > 0 (0 = off).")
    top_p: float = flag(1.0, "Top-p filter at T > 0 (1 = off).")
    max_new_tokens: int = flag(128, "New tokens per turn (cut at EOS).")
    limit: int | None = flag(None, "First N prompts.")
    sample: int | None = flag(None, "N prompts drawn with --seed (deterministic).")
    category: str | None = flag(None, "Category (spec_bench, mt_bench) or pair (wmt23).")
    seed: int = flag(0, "Seed for --sample and for sampling at T > 0.")
    baseline: str = flag(BASELINE, "vanilla (interleaved, same process) or none.")
    out: str | None = flag(None, "Results file (default results/<method>_<bench>_<target>_T<t>.jsonl).",
                           cli_type=Optional[Path], convert=_path_text)
    resume: bool = flag(False, "Continue an interrupted run in --out, skipping finished turns.")
    overwrite: bool = flag(False, "Replace an existing results file.")
    label: str | None = flag(None, "Method label in records and tables (default: method name).")
    dtype: str = flag("bfloat16", "auto (bfloat16 on CUDA and bf16-capable CPUs, else float32), "
                      "float32 for exactness checks, bfloat16 for speed.", cli_default="auto")
    device: str = flag("cpu", "auto (cuda if available, else cpu), cpu, cuda or cuda:N.", cli_default="auto")
    # "auto": accelerate spreads the target over the visible GPUs
    device_map: str | None = flag(None, "auto: spread a target larger than one GPU over the visible "
                                  "GPUs with accelerate (one process; on CPU a pass-through).")
    attn_implementation: str = flag("sdpa", "Target attention: sdpa, eager, or flash (flash-attn for prefill and "
                                    "chain verifies, SDPA for trees; CUDA only).", "--attn")
    data_dir: str | None = flag(None, "Folder of benchmark JSONL files (else $SPECBENCH_DATA).")
    system_prompt: str | None = flag(None, "System prompt for the chat template.")
    on_long_prompt: str = flag("skip", "skip (with a warning) or fail on prompts past the context.")
    warmup: bool = flag(True, "Run and discard one short generation per side first.")
    sweep: str | None = flag(None, "key=v1,v2,...: one side per value, labelled METHOD@key=v.")
    # more sides: "name" or "name@key=value@key=value"
    also: list[str] = flag([], "Another method in the same run: name or name@key=value[@key=value] (repeatable).",
                           "--also")
    # times the query stream is repeated (learning drafters keep their state)
    passes: int = flag(1, "Repeat the query stream N times (drafters that learn keep their state).")
    # times each prompt turn is generated and timed per side (the median one is reported)
    repeats: int = flag(1, "Generate and time each prompt turn R times per side (same tokens required); metrics "
                        "use the median.")
    # drafted nodes per verify for every side with a budget option (Drafter.budget_option)
    budget: int | None = flag(None, "Drafted nodes per verify call for every side whose method has a "
                              "node-budget option (`specbench list methods` names it); a side's own setting wins.")
    # requests decoded together (engine/batch_loop.py); 1 = one at a time through engine/loop.py
    batch_size: int = flag(1, "Requests decoded together: every side (and vanilla) decodes the stream B at a time, "
                           "one target forward per step for all B (1 = one request at a time).")
    continuous: bool = flag(False, "With --batch-size > 1: a finished request's slot takes the next prompt at once "
                            "(else static batches, refilled when all B have finished).")
    target_revision: str | None = flag(None, "Hub revision of --target (branch, tag or commit sha).")
    chat_template: str = flag("auto", "auto (tokenizer's template; vicuna_v1.1 for Vicuna models without one), "
                              "tokenizer, vicuna_v1.1 or plain.")  # prompts.TEMPLATES
    chat_template_kwargs: dict = flag({}, "key=value passed to apply_chat_template, e.g. enable_thinking=false "
                                      "(repeatable).", "--chat-template-kwargs", cli_default=[],
                                      cli_type=list[str], convert=_template_kwargs)
    # Set by the command from --opt/--config, or by a preset: no flag of their own.
    options: dict = field(default_factory=dict)
    preset: str | None = None  # the paper preset this run belongs to (written to the header; not in the hash)
    config_file: str | None = None  # --config: an input, so never the output (not in the identity)

    @property
    def method_label(self) -> str:
        return self.label or self.method

    def identity(self) -> dict:
        """What determines the records (limit/sample/out/resume do not: a resume may extend a run)."""
        keep = ("method", "bench", "options", "target", "dtype", "device", "attn_implementation", "temperature",
                "top_k", "top_p", "max_new_tokens", "seed", "baseline", "category", "system_prompt", "sweep", "also",
                "passes")
        ident = {k: v for k, v in asdict(self).items() if k in keep}
        ident["label"] = self.method_label
        if self.device_map:  # only when set, so hashes of earlier runs stay valid
            ident["device_map"] = self.device_map
        # Prompt rendering and weights revisions; only when set, so earlier runs keep their hash.
        for key, default in (("target_revision", None), ("chat_template", "auto"), ("chat_template_kwargs", {})):
            if getattr(self, key) != default:
                ident[key] = getattr(self, key)
        if self.repeats != 1:  # only then, so files written before --repeats existed keep their hash
            ident["repeats"] = self.repeats
        if self.budget is not None:
            ident["budget"] = self.budget
        if self.batch_size != 1:  # only when batched, so batch-1 runs keep their hash
            ident["batch_size"] = self.batch_size
            ident["continuous"] = self.continuous
        return ident


def _optional(hint: Any) -> Any:
    """``X | None`` as ``Optional[X]``, the spelling every Typer version reads."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return Optional[next(a for a in args if a is not type(None))]
    return hint


def run_flags() -> list[tuple[str, Any, Any, Flag]]:
    """(field name, command-line type, command-line default, Flag) for every field that has a flag, in
    field order."""
    hints = typing.get_type_hints(RunConfig)
    out = []
    for f in dataclasses.fields(RunConfig):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        kind = _optional(hints[f.name]) if spec.cli_type is _SAME else spec.cli_type
        if spec.cli_default is not _SAME:
            default = spec.cli_default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        out.append((f.name, kind, default, spec))
    return out


def config_values(flags: dict) -> dict:
    """RunConfig keyword arguments from the parsed flags (converted where the flag's form differs)."""
    values = {}
    for name, _, _, spec in run_flags():
        value = flags[name]
        values[name] = spec.convert(value) if spec.convert is not None else value
    return values
