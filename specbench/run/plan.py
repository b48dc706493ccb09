"""What one `specbench run` will do, decided before anything loads: ``plan_run(config) -> RunPlan``.

Every parse and every refusal that needs no model happens here, once: the configuration against its
declarations, the device and dtype (``auto`` resolved), each side's method options (``--budget`` laid under them
as typed values), the drafter references, what learning drafters and the batched loop refuse, the prompts
(selected, sampled, filtered), the stream of queries, the results files (a sweep's one per B) with what is
already on disk, and the header fields every file shares. ``Runner(plan)`` then only loads the models, decodes
and stores. A paper preset builds ``RunConfig`` objects and plans each through here too, so ``--dry-run``
refuses what the run would.

Imports nothing of torch at module level (`specbench --help` and the dry runs stay fast); the checks that
need it (a CUDA device, a method's classes) import it when they run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specbench.data.benchmarks import HEADER_KEY, Prompt, category_header
from specbench.data.safe_files import check_output
from specbench.data.streams import Query, build_queries, load_stream_prompts, stream_name
from specbench.engine import VANILLA as BASELINE
from specbench.errors import SpecbenchError
from specbench.run.run_config import RunConfig, validate
from specbench.sides import Side


@dataclass(frozen=True)
class PlannedSide:
    """A side with its method's class and its options parsed and checked (``--budget`` included)."""

    spec: Side
    cls: type
    options: Any

    @property
    def label(self) -> str:
        return self.spec.label


@dataclass
class RunPlan:
    cfg: RunConfig  # device and dtype resolved
    dtype_reason: str
    sides: list[PlannedSide]  # without the baseline
    prompts: list[Prompt]  # the stream's prompts, every rank's
    stream: list[Query]  # every query of every pass, every rank's
    bench: str  # what records name as their bench
    batch_sizes: list[int]  # the Bs a sweep decodes at ([batch_size] without one)
    outs: dict[int, Path]  # B -> its results file
    inputs: tuple  # (option, path) of every file the run reads
    shared: dict  # header fields every B's file holds

    def meta(self, size: int) -> dict:
        """The header of B's results file: its identity, the shared fields and the identity's hash."""
        from specbench.run.store import config_hash

        identity = self.cfg.at_batch(size).identity()
        return {**identity, **self.shared, "config_hash": config_hash(identity)}


def run_sides(cfg: RunConfig) -> list[Side]:
    """Every side of the run, in order, without the baseline, with ``--budget`` laid under each side's own
    options (a side's own setting of its budget option wins); two sides may not share a label."""
    from specbench.engine.registry import method_class

    sides = list(cfg.sides)
    if cfg.budget is not None:
        sides = [replace(s, options={**method_class(s.method).budget_options(cfg.budget), **s.options}) for s in sides]
    labels = [s.label for s in sides] + ([BASELINE] if cfg.baseline == BASELINE else [])
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes and not (len(sides) == 1 and sides[0].method == BASELINE):
        raise SpecbenchError(f"two sides share the label {dupes[0]!r}; give --label or drop the duplicate --also")
    return sides


def default_out(cfg: RunConfig) -> Path:
    target = Path(cfg.target).name.replace(".gguf", "")
    main = cfg.sides[0]
    label = main.stem + (f"@{'-'.join(main.shown)}-sweep" if main.shown else "")  # the main side's sweep
    passes = f"_x{cfg.passes}" if cfg.passes > 1 else ""
    batch = f"_B{cfg.batch_size}{'c' if cfg.continuous else ''}" if cfg.loop == "batched" else ""
    return Path("results") / f"{label}_{stream_name(cfg.bench)}{passes}{batch}_{target}_T{cfg.temperature:g}.jsonl"


def sweep_out(out: Path, size: int) -> Path:
    """A batch sweep's file for one B beside --out: sweep.jsonl -> sweep_B4.jsonl."""
    return out.with_name(f"{out.stem}_B{size}{out.suffix}")


def check_label_path(out: Path, label: str) -> None:
    """--label names the default results file: it must stay inside results/."""
    root = Path("results").resolve()
    if not out.resolve().is_relative_to(root) or "\x00" in label:
        raise SpecbenchError(f"--label {label!r} would put the results file outside results/ ({out}); use a label "
                             "without '..' or '/', or pass --out")


def run_inputs(cfg: RunConfig, sides: list[Side]) -> tuple:
    """(option, path) of every file the run reads that could be named as its output by mistake."""
    found = [("--bench", cfg.bench if cfg.prompts is None else None), ("--target", cfg.target),
             ("--config", cfg.config_file)]
    found += [(f"--opt {k}", v) for side in sides for k, v in side.options.items() if isinstance(v, str)]
    return tuple((option, path) for option, path in found if path)


def _parsed_sides(cfg: RunConfig) -> list[PlannedSide]:
    """Every side's options parsed and its references checked (paths exist, hub ids well formed; downloads
    happen at load), then what the run's settings refuse for some methods."""
    from specbench.engine.registry import method_class, parse_options

    sides = []
    for spec in run_sides(cfg):
        cls = method_class(spec.method)
        options = parse_options(cls, spec.options)
        cls.check_references(options)
        sides.append(PlannedSide(spec, cls, options))
    learners = [side.label for side in sides if side.cls.learns]
    if cfg.repeats > 1 and learners:
        raise SpecbenchError(f"--repeats {cfg.repeats} would feed every query {cfg.repeats} times to "
                             f"{', '.join(learners)}, which learn while serving; time them with --repeats 1")
    if cfg.loop == "batched":  # per instance: its options may decide (SpS's heuristic schedule, DVI's learn=false)
        for side in sides:
            reason = side.cls(side.options).batch_refusal()
            if reason:
                raise SpecbenchError(f"{side.label} {reason}")
    return sides


def _shared_header(cfg: RunConfig, sides: list[PlannedSide], stream: list[Query], world_size: int) -> dict:
    """The header fields of every B's file besides its identity (a sweep writes one file per B)."""
    from specbench.engine.registry import method_class

    with_baseline = cfg.with_baseline
    shared = {**({"preset": cfg.preset} if cfg.preset else {}), "loop": cfg.loop,
              **({"batch_sweep": list(cfg.batch_sweep)} if cfg.batch_sweep else {}),
              "method_options": {side.label: asdict(side.options) for side in sides},
              "stream": [q.prompt.id for q in stream],
              "stream_turns": [len(q.prompt.turns) for q in stream],
              HEADER_KEY: category_header(q.prompt for q in stream),  # where each prompt's category came from
              "sides": [side.label for side in sides] + ([BASELINE] if with_baseline else []),
              "methods": {side.label: side.cls.report_names() for side in sides}
              | ({BASELINE: method_class(BASELINE).report_names()} if with_baseline else {}),
              "world_size": world_size}
    if cfg.loop == "batched":  # per side: one drafter forward for the whole batch (true) or one per request
        shared["batched_drafting"] = {side.label: bool(side.cls(side.options).batched_drafting) for side in sides} \
            | ({BASELINE: False} if with_baseline else {})
    return shared


def _outs(cfg: RunConfig, batch_sizes: list[int], inputs: tuple) -> dict[int, Path]:
    """B -> its results file, each checked as an output (what it is, before whether it can be resumed)."""
    outs = {}
    for size in batch_sizes:
        out = Path(cfg.out) if cfg.out else default_out(cfg.at_batch(size))
        outs[size] = sweep_out(out, size) if cfg.out and cfg.batch_sweep else out
        if cfg.out is None:
            check_label_path(outs[size], cfg.method_label)
        check_output(outs[size], inputs)
    return outs


def plan_run(cfg: RunConfig, here: bool = True) -> RunPlan:
    """Everything a run will do, checked, without loading a model (prompt files are read). ``here=False`` (a
    preset's dry run, often made on another machine than the run) leaves the device, the dtype and the
    attention implementation as given, unchecked against this machine."""
    from specbench.data.distributed import launched
    from specbench.engine.devices import choose_dtype, resolve_device
    from specbench.engine.target import check_attention
    from specbench.run.store import check_resumable

    validate(cfg)
    # auto device/dtype are resolved (and bad devices refused) here; the records name the resolved values
    dtype_reason = ""
    if here:
        device = resolve_device(cfg.device)
        dtype, dtype_reason = choose_dtype(cfg.dtype, device)
        cfg = replace(cfg, device=device, dtype=dtype)
        check_attention(cfg.attn_implementation, device)
    sides = _parsed_sides(cfg)  # before any prompt file is read, so a typo fails in a second
    world = launched()  # torchrun's ranks, from the environment (the process group is joined at load)
    if world.active and cfg.device_map:
        raise SpecbenchError("--device-map spreads one target over every visible GPU; run it as one process, "
                             "not under torchrun")
    if world.active and cfg.loop == "batched":
        raise SpecbenchError("--batch-size decodes a batch in one process; run it without torchrun")
    prompts = cfg.prompts if cfg.prompts is not None else load_stream_prompts(
        cfg.bench, cfg.data_dir, limit=cfg.limit, sample=cfg.sample, seed=cfg.seed, category=cfg.category)
    stream = build_queries(prompts, cfg.passes)
    batch_sizes = list(cfg.batch_sweep) or [cfg.batch_size]
    inputs = run_inputs(cfg, [side.spec for side in sides])
    outs = _outs(cfg, batch_sizes, inputs)
    if cfg.resume:
        check_resumable(list(outs.values()), parts=world.active)
    return RunPlan(cfg, dtype_reason, sides, prompts, stream, prompts[0].bench if prompts else stream_name(cfg.bench),
                   batch_sizes, outs, inputs, _shared_header(cfg, sides, stream, world.size))
