"""`specbench run`: one or more method configurations and the vanilla baseline on one benchmark
(or a mixed stream), interleaved prompt by prompt in one process, every finished turn appended to
a results file that a rerun resumes.

Sides: the main method (or one side per value of ``--sweep key=v1,v2``, labelled ``method@key=v``)
plus every ``--also name[@key=value...]``, plus vanilla. Each side is one drafter instance that
lives for the whole run, so methods that learn while serving see the queries as one stream in the
recorded order (``--passes N`` repeats it)."""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from specbench import interrupt, metrics
from specbench.devices import resolve_device
from specbench.benchmarks import Prompt, check_data_dir_option
from specbench.drafter import Drafter, check_model_paths, method_class, parse_options
from specbench.engine import GenerationConfig, generate, generate_turns
from specbench.errors import SpecbenchError
from specbench.prompts import render_chat
from specbench.records import GenerationRecord
from specbench.results import RunStore, config_hash, environment_metadata
from specbench.streams import Query, build_queries, load_stream_prompts, stream_name
from specbench.target import DEFAULT_TARGET, Target, resolve_dtype
from specbench.verify import SamplingParams

BASELINE = "vanilla"
TREE_SLACK = 128  # room for a draft tree past max_new_tokens when checking the context window


@dataclass
class RunConfig:
    method: str
    bench: str
    options: dict = field(default_factory=dict)
    label: str | None = None
    target: str = DEFAULT_TARGET
    dtype: str = "bfloat16"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    baseline: str = BASELINE  # "vanilla" or "none"
    limit: int | None = None
    sample: int | None = None
    category: str | None = None
    data_dir: str | None = None
    system_prompt: str | None = None
    on_long_prompt: str = "skip"  # or "fail"
    out: str | None = None
    resume: bool = False
    overwrite: bool = False
    warmup: bool = True
    sweep: str | None = None  # "key=v1,v2,...": one side per value
    also: list[str] = field(default_factory=list)  # more sides: "name" or "name@key=value@key=value"
    passes: int = 1  # times the query stream is repeated (learning drafters keep their state)

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
        return ident


@dataclass(frozen=True)
class Side:
    """One method configuration in a run: its label in the records, method name and raw options."""

    label: str
    method: str
    options: dict


def parse_sweep(sweep: str) -> tuple[str, list[str]]:
    key, sep, values = sweep.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise SpecbenchError(f"--sweep expects key=v1,v2,... (got {sweep!r}), e.g. --sweep budget=16,32,64")
    return key.strip().replace("-", "_"), items


def parse_also(spec: str) -> Side:
    """``name@key=value@key=value`` -> a side labelled by the whole spec; a trailing
    ``@label=LABEL`` (everything after it, '@' included) names the side instead."""
    label = spec
    if "@label=" in spec:
        spec, label = spec.split("@label=", 1)
        if not label:
            raise SpecbenchError(f"--also {spec}@label= needs a label after 'label='")
    name, *pairs = spec.split("@")
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecbenchError(f"--also expects name or name@key=value[@key=value...] (got {spec!r})")
        options[key.strip().replace("-", "_")] = value.strip()
    return Side(label, name.strip(), options)


def run_sides(cfg: RunConfig) -> list[Side]:
    """Every method configuration of the run, in order, without the baseline."""
    if cfg.sweep:
        key, values = parse_sweep(cfg.sweep)
        sides = [Side(f"{cfg.method_label}@{key}={v}", cfg.method, {**cfg.options, key: v}) for v in values]
    else:
        sides = [Side(cfg.method_label, cfg.method, dict(cfg.options))]
    sides += [parse_also(a) for a in cfg.also]
    labels = [s.label for s in sides] + ([BASELINE] if cfg.baseline == BASELINE else [])
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes and not (len(sides) == 1 and sides[0].method == BASELINE):
        raise SpecbenchError(f"two sides share the label {dupes[0]!r}; give --label or drop the duplicate --also")
    return sides


MAX_PASSES = 1000  # a stream is materialised in memory; more passes than this is a typo


def validate(cfg: RunConfig) -> None:
    for name, value in (("--temperature", cfg.temperature), ("--top-p", cfg.top_p)):
        if not math.isfinite(value):
            raise SpecbenchError(f"{name} must be a finite number (got {value})")
    if cfg.limit is not None and cfg.limit < 1:
        raise SpecbenchError(f"--limit must be >= 1 (got {cfg.limit}); omit it to run every prompt")
    if cfg.temperature < 0:
        raise SpecbenchError(f"--temperature must be >= 0 (got {cfg.temperature}); 0 is greedy")
    if cfg.max_new_tokens < 1:
        raise SpecbenchError(f"--max-new-tokens must be >= 1 (got {cfg.max_new_tokens})")
    if cfg.baseline not in (BASELINE, "none"):
        raise SpecbenchError(f"--baseline must be 'vanilla' or 'none' (got {cfg.baseline!r})")
    if not 1 <= cfg.passes <= MAX_PASSES:
        raise SpecbenchError(f"--passes must be between 1 and {MAX_PASSES} (got {cfg.passes})")
    if cfg.on_long_prompt not in ("skip", "fail"):
        raise SpecbenchError(f"--on-long-prompt must be 'skip' or 'fail' (got {cfg.on_long_prompt!r})")
    try:
        SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    except ValueError as exc:
        raise SpecbenchError(str(exc)) from None
    resolve_dtype(cfg.dtype)
    resolve_device(cfg.device)
    check_data_dir_option(cfg.data_dir)
    if cfg.attn_implementation not in ("sdpa", "eager"):
        raise SpecbenchError(f"--attn must be sdpa or eager (got {cfg.attn_implementation!r}); "
                             "FlashAttention kernels cannot take the tree mask")


def default_out(cfg: RunConfig) -> Path:
    target = Path(cfg.target).name.replace(".gguf", "")
    label = cfg.method_label + (f"@{parse_sweep(cfg.sweep)[0]}-sweep" if cfg.sweep else "")
    passes = f"_x{cfg.passes}" if cfg.passes > 1 else ""
    return Path("results") / f"{label}_{stream_name(cfg.bench)}{passes}_{target}_T{cfg.temperature:g}.jsonl"


def record_seed(seed: int, prompt_id: str, turn: int) -> int:
    """A per-turn seed, so each record is reproducible on its own (resumed runs included)."""
    return (seed * 1_000_003 + zlib.crc32(f"{prompt_id}#{turn}".encode())) % (2**31)


class Runner:
    def __init__(self, cfg: RunConfig, console: Console | None = None) -> None:
        validate(cfg)
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        # Parse every side's options before loading anything, so a typo fails in a second.
        specs = run_sides(cfg)
        parsed = [(spec, method_class(spec.method)) for spec in specs]
        parsed = [(spec, cls, parse_options(cls, spec.options)) for spec, cls in parsed]
        for spec, cls, opts in parsed:
            check_model_paths(spec.method, opts)
        prompts = load_stream_prompts(cfg.bench, cfg.data_dir, limit=cfg.limit, sample=cfg.sample, seed=cfg.seed,
                                      category=cfg.category)
        self.queries: list[Query] = build_queries(prompts, cfg.passes)
        self.bench = prompts[0].bench if prompts else stream_name(cfg.bench)
        meta = {**cfg.identity(), "method_options": {spec.label: asdict(opts) for spec, _, opts in parsed},
                "config_hash": config_hash(cfg.identity()), "stream": [q.prompt.id for q in self.queries]}
        self.store = RunStore(cfg.out or default_out(cfg), meta, resume=cfg.resume, overwrite=cfg.overwrite)
        try:
            self._load(parsed)
        except BaseException:
            self.store.abandon()  # a bad target or drafter leaves no empty results file behind
            raise
        self.sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        self.skipped: list[str] = []
        learners = [label for label, d in self.sides if d.learns]
        if cfg.resume and self.store.done and learners:
            warnings.warn(f"resuming {', '.join(learners)}: what they learnt before the interruption is not restored, "
                          "so later queries start from the pre-deployment drafter; rerun with --overwrite for a clean stream")

    def _load(self, parsed) -> None:
        cfg = self.cfg
        self.target = Target.load(cfg.target, cfg.dtype, cfg.device, cfg.attn_implementation)
        self.sides: list[tuple[str, Drafter]] = []
        for spec, cls, opts in parsed:
            drafter = cls(opts)
            drafter.setup(self.target)
            self.sides.append((spec.label, drafter))
        if cfg.baseline == BASELINE and cfg.method != BASELINE:
            baseline = method_class(BASELINE)()
            baseline.setup(self.target)
            self.sides.append((BASELINE, baseline))
        self.store.start(environment_metadata(self.target.device))

    @property
    def prompts(self) -> list[Prompt]:
        return [q.prompt for q in self.queries]

    # ---- one prompt ------------------------------------------------------------------------
    def _fits(self, ids: list[int], prompt: Prompt) -> bool:
        need = len(ids) + self.cfg.max_new_tokens + TREE_SLACK
        if need <= self.target.max_context:
            return True
        msg = (f"prompt {prompt.id} needs {need} tokens (prompt {len(ids)} + --max-new-tokens + {TREE_SLACK} tree slack) "
               f"but the target's context is {self.target.max_context}")
        if self.cfg.on_long_prompt == "fail":
            raise SpecbenchError(msg + "; pass --on-long-prompt skip or lower --max-new-tokens")
        warnings.warn(msg + "; skipped")
        return False

    def _run_side(self, label: str, drafter: Drafter, query: Query) -> None:
        prompt = query.prompt

        def admit(ids: list[int]) -> bool:
            if self._fits(ids, prompt):
                return True
            self.skipped.append(prompt.id)
            return False

        def config_for(turn: int) -> GenerationConfig:
            return GenerationConfig(self.cfg.max_new_tokens, self.sampling, record_seed(self.cfg.seed, prompt.id, turn))

        for record in generate_turns(self.target, drafter, prompt.turns, config_for, self.cfg.system_prompt, label,
                                     finished=lambda turn: self.store.done.get((label, self.bench, prompt.id, turn)),
                                     admit=admit):
            record.bench, record.prompt_id, record.query_index = self.bench, prompt.id, query.index
            record.config_hash = self.store.meta["config_hash"]
            self.store.append(record)

    def _warmup(self) -> None:
        """One short generation per side, discarded: first calls pay for allocation and kernels."""
        ids = render_chat(self.target.tokenizer, [{"role": "user", "content": self.prompts[0].turns[0]}],
                          self.cfg.system_prompt)
        if len(ids) + 16 + TREE_SLACK > self.target.max_context:
            return
        for _, drafter in self.sides:
            if drafter.learns:
                continue  # a warm-up query would already change what the drafter has learnt
            generate(self.target, drafter, ids, GenerationConfig(16, self.sampling, 0))

    def run(self) -> list[GenerationRecord]:
        if self.cfg.warmup and self.prompts:
            self._warmup()
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                names = ", ".join(label for label, _ in self.sides if label != BASELINE)
                task = progress.add_task(f"{names} on {self.bench}", total=len(self.queries))
                for query in self.queries:
                    # Alternate which side goes first so slow drift does not favour any.
                    order = self.sides if query.index % 2 == 0 else self.sides[::-1]
                    for label, drafter in order:
                        self._run_side(label, drafter, query)
                    progress.advance(task)
        except interrupt.Interrupted as exc:
            exc.kept = f"{self.store.path} ({len(self.store.done)} records)"  # the CLI's resume line names it
            raise
        finally:
            self.store.close()
        return list(self.store.done.values())


def summary_table(records: list[GenerationRecord], temperature: float) -> Table:
    """τ, tokens/s, speedups, T_D% and greedy match per bench and method."""
    table = Table(title="specbench summary", show_lines=False)
    for col in ("bench", "method", "turns", "τ", "tok/s", "speedup", "decode-only", "T_D%", "greedy match"):
        table.add_column(col, justify="left" if col in ("bench", "method") else "right")
    benches = sorted({r.bench for r in records})
    for bench in benches:
        rows = [r for r in records if r.bench == bench]
        base = [r for r in rows if r.method == BASELINE]
        for method in sorted({r.method for r in rows}, key=lambda m: (m != BASELINE, m)):
            ours = [r for r in rows if r.method == method]
            has_base = bool(base) and method != BASELINE
            table.add_row(
                bench, method, str(len(ours)), f"{metrics.tau(ours):.2f}", f"{metrics.tokens_per_second(ours):.1f}",
                f"{metrics.speedup(ours, base):.2f}×" if has_base else "—",
                f"{metrics.speedup(ours, base, decode_only=True):.2f}×" if has_base else "—",
                f"{100 * metrics.draft_share(ours):.0f}%",
                f"{100 * metrics.greedy_match_rate(ours, base):.0f}%" if has_base and temperature == 0 else "—",
            )
    return table
