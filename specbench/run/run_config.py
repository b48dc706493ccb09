"""The run commands, each declared once: what one `specbench run` is (``RunConfig``, whose fields are also
the command's flags, and ``SideFlags``, how the command line writes the run's sides; ``PresetFlags`` sends it
to a preset instead), `specbench reproduce` (``ReproduceConfig``) and `specbench parity` (``ParityConfig``).

Every field is declared once with ``specbench.options.option``: its default, help, range or choices, the
checks no type can say (a dtype, a data folder, a chat template), the fields it cannot be set with and,
where the command line differs from the library, the flag's spelling, default (``auto`` where the library
picks a fixed value), type and conversion. Each command is built from its declarations
(``specbench.commands``), and ``specbench.options.validate`` enforces them, one line per error, before
anything loads. A run's methods are ``sides`` (``specbench.sides.Side``: method, options, label), built by
the command line from ``SideFlags`` or by a paper preset directly.

Kept free of torch so that `specbench --help` stays fast (the command line builds its commands from here).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Optional

from specbench import commands
from specbench.engine import DEFAULT_TARGET, MAX_BATCH, VANILLA as BASELINE
from specbench.options import data_dir_option, device_option, internal, like, option, validate as validate_options
from specbench.errors import SpecbenchError
from specbench.sides import Side, recorded_sides

MAX_PASSES = 1000  # a stream is materialised in memory; more passes than this is a typo
# The checks that need more than the declaration (torch, the prompt loaders) are "module:function" references,
# imported when a value is checked (specbench.options).
DTYPE = "specbench.engine.target:check_dtype"


def _template_kwargs(items: list[str]) -> dict:
    from specbench.engine.prompts import parse_template_kwargs

    return parse_template_kwargs(list(items))


def _method_options(items: list[str]) -> dict:
    from specbench.sides import parse_opts

    return parse_opts(list(items))


def _chat_kwargs(kwargs: dict) -> None:
    from specbench.engine.prompts import ChatFormat

    ChatFormat("auto", kwargs)


@dataclass
class SideFlags:
    """The flags that name a run's sides; ``specbench.sides.cli_sides`` turns them into ``Side`` objects
    (--method and --bench are optional on the command line because --preset may stand in for them)."""

    method: Optional[str] = option(None, "Method name (see `specbench list methods`).", flag=("--method", "-m"))
    opt: list[str] = option([], "Method option key=value (repeatable).", flag="--opt")
    config: Optional[str] = option(None, "YAML/JSON file of method options.", cli_type=Optional[Path],
                                   convert=commands.path_text)
    label: Optional[str] = option(None, "Method label in records and tables (default: method name).")
    sweep: Optional[str] = option(None, "key=v1,v2,...: one side per value, labelled METHOD@key=v.")
    also: list[str] = option([], "Another method in the same run: name or name@key=value[@key=value] "
                                 "(repeatable; @label=LABEL names it).", flag="--also")


@dataclass
class PresetFlags:
    """`specbench run --preset NAME` runs a paper preset instead: it takes the flags `specbench reproduce`
    declares (``ReproduceConfig``; --out is its folder) and refuses the others."""

    preset: Optional[str] = option(None, "Run a paper preset instead (= `specbench reproduce PRESET`; --out is its "
                                         "folder).")
    dry_run: bool = option(False, "With --preset: print the plan, load no model.")


@dataclass
class RunConfig:
    sides: list[Side] = internal()  # the methods, in order, without the baseline
    bench: str = option(help="Benchmark name or a .jsonl file.", flag=("--bench", "-b"), cli_default=None,
                        cli_type=Optional[str])
    target: str = option(DEFAULT_TARGET, f"Target: {DEFAULT_TARGET}, a .gguf file, a model folder or a hub id "
                         "org/name or org/name@REVISION.")
    temperature: float = option(0.0, "0 = greedy; > 0 samples (lossless either way).", ge=0, note="0 is greedy")
    top_k: int = option(0, "Top-k filter at T > 0 (0 = off).", ge=0)
    top_p: float = option(1.0, "Top-p filter at T > 0 (1 = off).", gt=0, le=1)
    max_new_tokens: int = option(128, "New tokens per turn (cut at EOS).", ge=1, tokens=True)
    limit: Optional[int] = option(None, "First N prompts.", ge=1, note="omit it to run every prompt")
    sample: Optional[int] = option(None, "N prompts drawn with --seed (deterministic).", ge=1)
    category: Optional[str] = option(None, "Category (spec_bench, mt_bench) or pair (wmt23).")
    seed: int = option(0, "Seed for --sample and for sampling at T > 0.")
    baseline: Literal[BASELINE, "none"] = option(BASELINE, "vanilla (interleaved, same process) or none.")
    out: Optional[str] = option(None, "Results file (default results/<method>_<bench>_<target>_T<t>.jsonl).",
                                cli_type=Optional[Path], convert=commands.path_text)
    resume: bool = option(False, "Continue an interrupted run in --out, skipping finished turns.", excludes="overwrite")
    overwrite: bool = option(False, "Replace an existing results file.")
    dtype: str = option("bfloat16", "auto (bfloat16 on CUDA and bf16-capable CPUs, else float32), "
                        "float32 for exactness checks, bfloat16 for speed.", cli_default="auto", check=DTYPE)
    device: str = device_option("cpu", cli_default="auto")
    # accelerate's placement strategies: "auto" spreads the target over the visible GPUs
    device_map: Optional[Literal["auto", "balanced", "balanced_low_0", "sequential"]] = option(
        None, "auto: spread a target larger than one GPU over the visible GPUs with accelerate (one process; on CPU "
              "a pass-through).")
    attn_implementation: str = option("sdpa", "Target attention: sdpa, eager, or flash (flash-attn for prefill and "
                                      "chain verifies, SDPA for trees; CUDA only).", flag="--attn")
    engine: Literal["eager", "compiled"] = option("eager", "eager (the model as transformers runs it, a growing KV "
                                                  "cache) or compiled (a static KV cache and a few "
                                                  "torch.compile'd graphs; CUDA graphs on a GPU).")
    data_dir: Optional[str] = data_dir_option()
    system_prompt: Optional[str] = option(None, "System prompt for the chat template.")
    on_long_prompt: Literal["skip", "fail"] = option("skip", "skip (with a warning) or fail on prompts past the "
                                                             "context.")
    warmup: bool = option(True, "Run and discard one short generation per side first.")
    # times the query stream is repeated (learning drafters keep their state)
    passes: int = option(1, "Repeat the query stream N times (drafters that learn keep their state).", ge=1,
                         le=MAX_PASSES, note="the stream is held in memory")
    # times each prompt turn is generated and timed per side (the median one is reported)
    repeats: int = option(1, "Generate and time each prompt turn R times per side (same tokens required); metrics "
                             "use the median.", ge=1)
    # drafted nodes per verify for every side with a budget option (Drafter.budget_option)
    budget: Optional[int] = option(None, "Drafted nodes per verify call for every side whose method has a "
                                         "node-budget option (`specbench list methods` names it); a side's own "
                                         "setting wins.", ge=1, tokens=True)
    # requests decoded together (engine/batch_loop.py); 1 = one at a time through engine/loop.py. A batch's
    # turns share their steps, so a turn cannot be timed alone (--repeats) or re-run alone beside its twin
    # (--check forced replays each turn through the batch-1 loop, not the batched path that was timed).
    # A sweep (--batch-size 1,2,4): batch_size is its largest B (what the checks above apply to), batch_sweep every
    # B; each B writes a file of its own (``sweep_out``) and the sides run at every B, interleaved, in one process.
    batch_size: int = option(1, "Requests decoded together: every side (and vanilla) decodes the stream B at a time, "
                                "one target forward per step for all B (1 = one request at a time). A list B1,B2,... "
                                "sweeps: every side runs at each B in one process, one results file per B.", ge=1,
                             le=MAX_BATCH, excludes=("repeats", "turn_check"), cli_type=str, cli_default="1",
                             convert=lambda text: max(parse_batch_sizes(text)))
    batched_loop: bool = option(False, "Decode through the batched loop even at --batch-size 1 (a sweep's B = 1 always "
                                       "does), to compare it with the one-request loop.",
                                excludes=("repeats", "turn_check"))
    continuous: bool = option(False, "With --batch-size > 1: a finished request's slot takes the next prompt at once "
                                     "(else static batches, refilled when all B have finished).",
                              requires="batch_size")
    batch_sweep: list = internal([])  # the B values of a sweep, ascending (the command line's --batch-size B1,B2,...)
    # an untimed check after each method turn (specbench/engine/forced.py)
    turn_check: Optional[Literal["forced"]] = option(
        None, "forced: after each method turn, an untimed pass that commits vanilla's tokens and compares every "
              "verify row with vanilla's (needs T = 0 and the vanilla baseline).", flag="--check")
    target_revision: Optional[str] = option(None, "Hub revision of --target (branch, tag or commit sha).")
    chat_template: str = option("auto", "auto (tokenizer's template; vicuna_v1.1 for Vicuna models without one), "
                                "tokenizer, vicuna_v1.1 or plain.", check="specbench.engine.prompts:ChatFormat")
    chat_template_kwargs: dict = option({}, "key=value passed to apply_chat_template, e.g. enable_thinking=false "
                                        "(repeatable).", flag="--chat-template-kwargs", cli_default=[],
                                        cli_type=list[str], convert=_template_kwargs, check=_chat_kwargs)
    # Set by code, never a flag: a paper preset's name (in the header, not in the identity), the --config
    # file (an input, so never the output), and a preset's selected, framed prompts (then --bench names them).
    preset: Optional[str] = internal(None)
    config_file: Optional[str] = internal(None)
    prompts: Optional[list] = internal(None)

    @property
    def method_label(self) -> str:
        """The main side's label stem: what the default results file is named after."""
        return self.sides[0].stem

    @property
    def loop(self) -> str:
        """Which decode loop runs: "batched" (engine/batch_loop.py) or "single" (engine/loop.py)."""
        return "batched" if self.batch_size > 1 or self.batched_loop or self.batch_sweep else "single"

    def at_batch(self, size: int) -> "RunConfig":
        """One B of a sweep (itself when there is no sweep): its batch size, through the batched loop."""
        if not self.batch_sweep:
            return self
        return replace(self, batch_size=size, batched_loop=True)

    @property
    def with_baseline(self) -> bool:
        """A vanilla side runs beside the methods (not when the run is vanilla alone)."""
        return self.baseline == BASELINE and self.sides[0].method != BASELINE

    def check(self, owner: str) -> None:
        """Rules that span fields."""
        from specbench.engine import hub
        from specbench.engine.target import check_model_file, named_model

        if not self.sides:
            raise SpecbenchError("a run needs at least one side (--method)")
        named = named_model(self.target)
        if not named:  # a file that is no .gguf would otherwise be read as a hub id
            check_model_file(self.target)
        if not named and not self.target.endswith(".gguf"):  # a folder or a well-formed hub id
            hub.check_reference(self.target, self.target_revision, "target")
        elif self.target_revision:
            raise SpecbenchError(f"--target-revision applies to hub ids; {self.target!r} is not one")
        if self.batch_sweep and (len(self.batch_sweep) < 2 or max(self.batch_sweep) != self.batch_size):
            raise SpecbenchError(f"a batch sweep needs two or more sizes, the largest being batch_size "
                                 f"(got {self.batch_sweep} with batch_size {self.batch_size})")
        if self.engine == "compiled" and self.loop == "batched":
            raise SpecbenchError("--engine compiled decodes one request at a time; drop --batch-size/--batch-sweep "
                                 "or use --engine eager")
        if self.engine == "compiled":
            from specbench.engine.target import check_engine_setup

            check_engine_setup(self.engine, self.attn_implementation, self.device_map)
        filters = [flag for flag, on in (("--top-k", self.top_k != 0), ("--top-p", self.top_p != 1)) if on]
        if self.temperature == 0 and filters:  # greedy decoding takes the argmax: a filter would be recorded, not used
            named = " and ".join(filters)
            raise SpecbenchError(f"{named} appl{'y' if len(filters) > 1 else 'ies'} only when sampling, and "
                                 f"--temperature 0 is greedy; drop {named} or pass a --temperature above 0")
        if self.turn_check == "forced" and (self.temperature != 0 or not self.with_baseline):
            raise SpecbenchError("--check forced compares each method turn with vanilla's greedy turn: it needs "
                                 f"--temperature 0, --baseline {BASELINE} and a method other than {BASELINE}")

    def identity(self) -> dict:
        """What determines the records (limit/sample/out/resume do not: a resume may extend a run)."""
        ident: dict[str, Any] = {k: getattr(self, k) for k in IDENTITY}
        ident["side_specs"] = [side.header() for side in self.sides]
        if self.device_map:  # only when set
            ident["device_map"] = self.device_map
        # Prompt rendering and weights revisions; only when set.
        for key, default in (("target_revision", None), ("chat_template", "auto"), ("chat_template_kwargs", {})):
            if getattr(self, key) != default:
                ident[key] = getattr(self, key)
        if self.repeats != 1:
            ident["repeats"] = self.repeats
        if self.engine != "eager":  # only when set, so eager runs keep their hash
            ident["engine"] = self.engine
        if self.budget is not None:
            ident["budget"] = self.budget
        if self.batch_size != 1 or self.batched_loop:  # only when batched, so batch-1 runs keep their hash
            ident["batch_size"] = self.batch_size
            ident["continuous"] = self.continuous
        if self.batch_size == 1 and self.batched_loop:  # batch 1 through the batched loop: another experiment
            ident["batched_loop"] = True
        if self.turn_check is not None:  # the records carry its figures
            ident["turn_check"] = self.turn_check
        if self.prompts is not None:  # prompts given in memory: their text is part of the experiment
            text = json.dumps([[p.bench, p.id, p.turns] for p in self.prompts], ensure_ascii=False)
            ident["prompts_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return ident


def parse_batch_sizes(text: str | int) -> list[int]:
    """``--batch-size`` "4" or "1,2,4,8,16" -> the B values, ascending, each in [1, MAX_BATCH]."""
    try:
        sizes = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        raise SpecbenchError(f"--batch-size expects B or a list B1,B2,... of whole numbers (got {text!r})") from None
    if not sizes:
        raise SpecbenchError(f"--batch-size expects B or a list B1,B2,... of whole numbers (got {text!r})")
    bad = next((b for b in sizes if not 1 <= b <= MAX_BATCH), None)
    if bad is not None:  # worded as the declaration's own range error
        raise SpecbenchError(f"--batch-size must be in [1, {MAX_BATCH}] (got {bad})")
    return sizes


def drafter_map(items: list[str]) -> dict[str, str]:
    """``--drafter METHOD=PATH_OR_HUB_ID`` items -> {method: path}."""
    drafters = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise SpecbenchError(f"--drafter expects METHOD=PATH_OR_HUB_ID (got {item!r})")
        drafters[name.strip()] = value.strip()
    return drafters


def check_drafters(drafters: dict[str, str]) -> None:
    """Each ``--drafter METHOD=VALUE`` names a method that loads drafter weights, and an existing folder or a
    well-formed hub id (what the run would refuse only once the model is loaded), so ``--dry-run`` refuses it."""
    from specbench.engine import hub
    from specbench.engine.registry import method_class

    for name, value in drafters.items():
        cls = method_class(name)
        if not cls.weight_options:
            raise SpecbenchError(f"--drafter {name}={value}: {name} loads no drafter weights; drop it")
        if not cls.builtin_reference(value):
            hub.check_reference(value, None, f"--drafter {name}")


def _method_names() -> list[str]:
    from specbench.engine.registry import available_methods

    return list(available_methods())


@dataclass
class ReproduceConfig:
    """`specbench reproduce` (and `specbench run --preset`): a published table's protocol on one target
    (``specbench.run.preset``)."""

    preset: str = option(help="Paper preset (see `specbench list presets`).", positional=True)
    target: str = option(help="Target: a hub id (e.g. meta-llama/Llama-3.1-8B-Instruct) or a folder.")
    limit: Optional[int] = option(None, "First N prompts of each bench after the paper's selection.", ge=1)
    dry_run: bool = option(False, "Print the full plan (benches, counts, methods, drafters, forwards); load no model.")
    out_dir: Optional[str] = option(None, "Folder for results files (default results/<preset>).",
                                    cli_type=Optional[Path], convert=commands.path_text)
    device: str = device_option()
    dtype: Optional[str] = option(None, "Override the preset's dtype.", check=DTYPE)
    engine: Literal["eager", "compiled"] = option("eager", "eager or compiled (as for `specbench run`).")
    max_new_tokens: Optional[int] = like(RunConfig, "max_new_tokens", default=None,
                                         help="Override (or supply, where the paper states none) max new tokens.")
    temperature: Optional[float] = option(None, "Run only this temperature instead of the preset's (0 = greedy).",
                                          ge=0, note="0 is greedy")
    drafter: dict = option({}, "METHOD=PATH_OR_HUB_ID: a drafter for a method the preset cannot name (repeatable).",
                           flag="--drafter", cli_default=[], cli_type=list[str], convert=drafter_map,
                           choices=_method_names, check=check_drafters,
                           note="not a registered method; see `specbench list methods`")
    target_revision: Optional[str] = option(None, "Target revision (commit, tag or branch).")
    data_dir: Optional[str] = data_dir_option()
    resume: bool = option(False, "Continue interrupted results files.", excludes="overwrite")
    overwrite: bool = option(False, "Replace existing results files.")


@dataclass
class ParityConfig:
    """`specbench parity`: a method beside its authors' implementation (``specbench.run.parity``)."""

    # a parity row: a method name, or METHOD-WHAT for a method's second reference
    method: Optional[str] = option(None, "Method to compare with its authors' implementation.", positional=True,
                                   excludes="all_methods")
    all_methods: bool = option(False, "Every method with a registered reference, in turn.", flag="--all",
                               excludes=("options", "out", "reference_src"))
    bench: str = option("humaneval", "Benchmark name or a .jsonl file.")
    limit: int = option(12, "First N prompts.", ge=1)
    max_new_tokens: int = like(RunConfig, "max_new_tokens", help="New tokens per prompt (cut at EOS).", ge=2,
                               note="the first token comes from the prefill, decoding starts at the second")
    target: str = option(DEFAULT_TARGET, "Target (as for `specbench run`).")
    device: str = device_option("cpu", "cpu, cuda or cuda:N (cuda writes under results/gpu/).")
    dtype: str = option("float32", "float32 (exact text) or bfloat16.", check=DTYPE)
    options: dict = option({}, "Method option key=value, given to both sides (repeatable).", flag="--opt",
                           cli_default=[], cli_type=list[str], convert=_method_options)
    data_dir: Optional[str] = data_dir_option()
    out: Optional[str] = option(None, "Parity file (default results/[gpu/]parity/<method>_<bench>_<target>.jsonl).",
                                cli_type=Optional[Path], convert=commands.path_text)
    # a snapshot of the authors' repository (references that import one)
    reference_src: Optional[str] = option(None, "A checkout of the authors' repository, for references imported from "
                                                "one at run time (else each reference's environment variable, named "
                                                "in its refusal).")

    @property
    def on_gpu(self) -> bool:
        return str(self.device).startswith("cuda")


# What every run's identity holds; the rest of ``RunConfig.identity`` is there only when set.
IDENTITY = ("bench", "target", "dtype", "device", "attn_implementation", "temperature", "top_k", "top_p",
            "max_new_tokens", "seed", "baseline", "category", "system_prompt", "passes")
_WHEN_SET = ("device_map", "target_revision", "chat_template", "chat_template_kwargs", "repeats", "engine", "budget",
             "turn_check")


def identity_of_header(meta: dict) -> dict | None:
    """The identity a header written before ``side_specs`` describes, in today's form (its sides read from
    the command line it recorded, ``specbench.sides.recorded_sides``), so that such a run still resumes;
    None for a header that has ``side_specs`` (its hash is today's already) or lacks a field."""
    if "side_specs" in meta or any(k not in meta for k in IDENTITY):
        return None
    ident = {k: meta[k] for k in IDENTITY}
    ident["side_specs"] = [side.header() for side in recorded_sides(meta)]
    ident.update({k: meta[k] for k in _WHEN_SET if k in meta})
    return ident


# Identity keys that are no flag of their own, as a mismatch names them.
_IDENTITY_WORDS = {"side_specs": "the sides (--method, --opt, --also, --sweep, --label)",
                   "prompts_sha256": "the preset's prompts"}


def identity_differences(theirs: dict, ours: dict) -> list[str]:
    """What differs between a results header (``theirs``) and a run's identity (``ours``, ``RunConfig.identity``),
    one phrase per option: "--temperature 0.0 then, 0.5 now"; an option set on one side only counts too."""
    label = commands.label(RunConfig)

    def shown(key: str, value: Any) -> str:
        if value is None:
            return "unset"
        if key == "side_specs" and isinstance(value, list):  # each side as --also spells it: method@key=value
            return ", ".join(str(s.get("method")) + "".join(f"@{k}={v}" for k, v in (s.get("options") or {}).items())
                             + (f"@label={s.get('label')}" if s.get("label") != s.get("method") else "")
                             for s in value if isinstance(s, dict))
        return json.dumps(value, ensure_ascii=False, default=str)

    def same(a: Any, b: Any) -> bool:  # as the hash compares them
        return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)

    keys = [*ours, *(k for k in (*_WHEN_SET, "batch_size", "continuous", "batched_loop", "prompts_sha256")
                     if k in theirs and k not in ours)]
    return [f"{_IDENTITY_WORDS.get(k) or label(k)} {shown(k, theirs.get(k))} then, {shown(k, ours.get(k))} now"
            for k in dict.fromkeys(keys) if not same(theirs.get(k), ours.get(k))]


def validate(cfg: RunConfig) -> RunConfig:
    """Every field against its declaration (ranges, choices, checks, conflicts), then ``check``."""
    return validate_options(cfg, "run", commands.label(RunConfig))
