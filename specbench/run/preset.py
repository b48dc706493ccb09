"""Paper presets: a published table's evaluation protocol as data (YAML files that method packages ship
under the entry-point group ``specbench.presets``), expanded into ordinary ``specbench run`` configurations.

A preset names the paper's benches (with its prompt framing and sample selection), max new tokens,
temperatures, methods with their budgets, the published drafter of each method per target, and the
paper's metric; every setting carries its source. A preset may ship named ``variants`` (e.g. the
authors' released harness where it departs from the paper), listed as ``<preset>-<variant>``: the
same file with the variant's method options and bench settings laid over it.

``build_plan`` turns a preset and a target into one ``RunConfig`` per bench x temperature (plus, for each
other attention implementation the preset's ``baseline_attn`` names, a run per bench x temperature of
vanilla and of the methods whose ``attn`` lists it), without loading any model: each config holds its
sides (``specbench.sides.Side``) and its selected, framed prompts as data; ``format_plan`` prints it
(``--dry-run``); ``execute`` runs each config through ``Runner``. `specbench reproduce` is declared once,
as ``ReproduceConfig`` (`specbench run --preset` takes the same flags).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specbench.data.benchmarks import Prompt, load_benchmark
from specbench.data.preset_files import load_preset
from specbench.engine.registry import available_methods, method_class
from specbench.errors import SpecbenchError
from specbench.run.run_config import ReproduceConfig
from specbench.engine import VANILLA as BASELINE
from specbench.run.run_config import RunConfig
from specbench.run.store import has_records
from specbench.sides import Side

_ENTRY_META = ("source", "train", "revision", "note")  # drafter-entry keys that are not method options
ATTN_TAGS = {"flash_attention_2": "fa2", "flash_attention_3": "fa3", "eager": "eager"}  # label suffixes


# ------------------------------------------------------------------------------------------- the command

def plan_for(cfg: ReproduceConfig) -> "Plan":
    return build_plan(cfg.preset, cfg.target, limit=cfg.limit, out_dir=cfg.out_dir or Path("results") / cfg.preset,
                      drafters=cfg.drafter, device=cfg.device, dtype=cfg.dtype, max_new_tokens=cfg.max_new_tokens,
                      data_dir=cfg.data_dir, target_revision=cfg.target_revision, resume=cfg.resume,
                      overwrite=cfg.overwrite, temperature=cfg.temperature, engine=cfg.engine)


# ------------------------------------------------------------------------------------------- the plan

@dataclass
class BenchPlan:
    bench: str
    wanted: int  # the paper's count
    prompts: list[Prompt] = field(default_factory=list)  # selected and framed
    selection: str = ""
    unavailable: str = ""
    notes: list[str] = field(default_factory=list)
    source: str = ""

    @property
    def turns(self) -> int:
        return sum(len(p.turns) for p in self.prompts)


@dataclass(frozen=True)
class SidePlan:
    side: Side
    source: str

    @property
    def label(self) -> str:
        return self.side.label


@dataclass
class PresetRun:
    cfg: RunConfig
    bench: str
    temperature: float
    sides: list[SidePlan]


@dataclass
class Plan:
    preset: dict
    target: str
    target_entry: dict
    benches: list[BenchPlan]
    sides: list[SidePlan]
    skipped: list[tuple[str, str]]  # (method label, why it does not run, with how to get its drafter)
    runs: list[PresetRun]
    max_new_tokens: int
    temperatures: list[float]
    notes: list[str]

    @property
    def name(self) -> str:
        return self.preset["name"]


def match_target(preset: dict, target: str) -> dict | None:
    """The preset's entry for TARGET: the same hub id, or a local folder with the same name."""
    for entry in preset["targets"]:
        if target == entry["id"] or Path(target.rstrip("/")).name == entry["id"].split("/")[-1]:
            return entry
    return None


def select_prompts(prompts: list[Prompt], spec: dict) -> tuple[list[Prompt], str]:
    """The paper's selection of ``n`` prompts: first | shuffle (HF ``Dataset.shuffle(seed).select``, which
    permutes with numpy's default_rng(seed) and is skipped when the set is no larger than n) | sample
    (specbench's --sample: seeded random subset kept in file order)."""
    n, kind, seed = spec.get("n"), spec.get("select", "first"), int(spec.get("seed", 0))
    if n is None or n >= len(prompts):
        return list(prompts), f"all {len(prompts)}"
    if kind == "first":
        return prompts[:n], f"first {n}"
    if kind == "shuffle":
        order = np.random.default_rng(seed).permutation(len(prompts))[:n]
        return [prompts[i] for i in order], f"shuffle(seed={seed}).select({n})"
    if kind == "sample":
        keep = sorted(random.Random(seed).sample(range(len(prompts)), n))
        return [prompts[i] for i in keep], f"random {n} (seed {seed})"
    raise SpecbenchError(f"preset bench {spec['bench']!r}: unknown select {kind!r} (first, shuffle or sample)")


def frame(prompt: Prompt, template) -> Prompt:
    """Each user turn through the paper's template: {turn} = our stored turn, {meta[key]} = a raw field. A list
    of {if: FIELD, template} entries takes the first whose field is non-empty (an entry without ``if`` always
    applies), as loaders that frame a row one way or another do."""
    if isinstance(template, list):
        template = next((t["template"] for t in template if not t.get("if") or prompt.meta.get(t["if"])), None)
        if template is None:
            raise SpecbenchError(f"preset templates give no framing for prompt {prompt.id}; add one without 'if'")
    try:
        turns = [template.format(turn=t, meta=prompt.meta) for t in prompt.turns]
    except (KeyError, IndexError) as e:
        raise SpecbenchError(f"preset template {template!r} needs {e} in the meta of prompt {prompt.id}") from None
    return dataclasses.replace(prompt, turns=turns)


def _bench_plan(spec: dict, data_dir: str | None, limit: int | None) -> BenchPlan:
    # paper_n: the paper's own count, when the preset (or a variant) selects another n.
    plan = BenchPlan(spec["bench"], spec.get("paper_n") or spec.get("n") or 0, source=spec.get("source", ""))
    if spec.get("note"):
        plan.notes.append(spec["note"])
    if spec.get("unavailable"):
        plan.unavailable = spec["unavailable"]
        return plan
    if spec.get("hub_dataset"):
        try:
            prompts = hub_dataset_prompts(spec["bench"], spec["hub_dataset"])
        except SpecbenchError as e:
            plan.unavailable = str(e)
            return plan
    else:
        prompts = load_benchmark(spec["bench"], data_dir, category=spec.get("category"))
    chosen, plan.selection = select_prompts(prompts, spec)
    wanted = spec.get("n") or plan.wanted
    if wanted and len(chosen) < wanted:
        plan.notes.append(f"only {len(chosen)} of the {wanted} prompts the preset selects are available")
    if limit is not None:
        chosen = chosen[:limit]
        plan.selection += f", --limit {limit}"
    plan.prompts = [frame(p, spec.get("template", "{turn}")) for p in chosen]
    return plan


def hub_dataset_prompts(bench: str, spec: dict) -> list[Prompt]:
    """The rows of a Hugging Face dataset split as prompts (id = row index, meta = the row's fields, one
    empty turn for the template to fill), for a paper whose loader reads the Hub rather than our data dir.
    Its parquet files come through the HF cache (``HF_HUB_OFFLINE=1``: the cache only); one line if absent."""
    import pandas as pd
    from huggingface_hub import snapshot_download

    from specbench.engine import hub

    repo, split, revision = spec["path"], spec.get("split", "train"), spec.get("revision")
    try:
        folder = Path(snapshot_download(repo, repo_type="dataset", revision=revision, cache_dir=hub.hub_cache(),
                                        allow_patterns=[f"*{split}-*.parquet", f"*/{split}/*.parquet"],
                                        local_files_only=hub.offline()))
    except Exception as e:  # offline and not cached, network down, no such repo: one line
        why = "HF_HUB_OFFLINE=1 and not in the HF cache" if hub.offline() else type(e).__name__
        raise SpecbenchError(f"needs the {split} split of {repo} from the Hugging Face Hub, which could not be read "
                             f"({why}); run once online (or with the dataset in the HF cache)") from None
    files = sorted(folder.rglob("*.parquet"))
    if not files:
        raise SpecbenchError(f"needs the {split} split of {repo}: no parquet files for it in {folder}")
    rows = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).to_dict("records")
    return [Prompt(bench, str(i), [""], meta=row) for i, row in enumerate(rows)]


def drafter_option(name: str) -> str:
    """The method option a drafter entry fills when given as ``--drafter NAME=VALUE``: the weights that
    method NAME adds itself, i.e. the last of its ``weight_options`` (a subclass appends its own to its
    parent's); ``path`` for a name that is no registered method or has no weights option."""
    if name not in available_methods():
        return "path"
    options = method_class(name).weight_options
    return options[-1] if options else "path"


def _drafter_options(entry: dict, names: list[str]) -> tuple[dict, str | None]:
    """Method options from the target's drafter entries, or (_, how to get the missing drafter)."""
    options: dict = {}
    for name in names:
        d = entry.get("drafters", {}).get(name)
        if d is None:
            return {}, f"no {name} drafter is known for {entry['id']}; give one with --drafter {name}=PATH_OR_HUB_ID"
        opts = {k: v for k, v in d.items() if k not in _ENTRY_META}
        if not opts:
            return {}, f"drafter not published: {d.get('train', 'train one')}; then --drafter {name}=FOLDER"
        options.update(opts)
        if d.get("revision"):
            options["revision"] = d["revision"]
    return options, None


def _sides(preset: dict, entry: dict) -> tuple[list[dict], list[tuple[str, str]]]:
    """Runnable methods (with their drafter options) and the skipped ones with the reason."""
    runnable, skipped = [], []
    paper_targets = {t["id"] for t in preset["targets"]}
    for m in preset["methods"]:
        if m.get("targets") and entry["id"] in paper_targets and entry["id"] not in m["targets"]:
            why = m.get("targets_note") or f"the paper has no {m['label']} row for {entry['id']}"
            skipped.append((m["label"], why))
            continue
        names = m.get("drafter") or []
        names = [names] if isinstance(names, str) else list(names)
        drafter_opts, why = _drafter_options(entry, names)
        for optional in m.get("drafter_optional") or []:
            if optional in entry.get("drafters", {}):
                drafter_opts.update(_drafter_options(entry, [optional])[0])
        if why:
            skipped.append((m["label"], why))
        else:
            runnable.append({**m, "drafter_options": drafter_opts})
    return runnable, skipped


def _side_plans(method: dict, bench: str, target_id: str) -> list[SidePlan]:
    options = {**method["drafter_options"], **(method.get("options") or {})}
    source = method.get("source", "")
    for o in method.get("overrides") or []:
        if target_id in o.get("targets", [target_id]) and bench in o.get("benches", [bench]):
            options.update(o["options"])
            source += f"; {o.get('source', '')}"
    if not method.get("sweep"):
        return [SidePlan(Side(method["method"], options, method["label"]), source)]
    key, _, values = method["sweep"].partition("=")
    return [SidePlan(Side(method["method"], {**options, key: v}, method["label"], (key,)), source)
            for v in values.split(",")]


def _supported(field_name: str) -> bool:
    return field_name in RunConfig.__dataclass_fields__


def build_plan(name: str, target: str, *, limit: int | None = None, out_dir: str | Path = "results",
               drafters: dict[str, str] | None = None, device: str = "cpu", dtype: str | None = None,
               max_new_tokens: int | None = None, data_dir: str | None = None, target_revision: str | None = None,
               resume: bool = False, overwrite: bool = False, temperature: float | None = None,
               engine: str = "eager") -> Plan:
    """Everything a reproduction will run, as RunConfigs; loads prompt files, never a model."""
    preset = load_preset(name)
    notes: list[str] = []
    entry = match_target(preset, target)
    if entry is None:
        known = ", ".join(t["id"] for t in preset["targets"])
        notes.append(f"target {target} is not one of the paper's ({known}); drafters must come from --drafter")
        entry = {"id": target, "drafters": {}, "chat_template_kwargs": {}}
    entry = {**entry, "drafters": dict(entry.get("drafters") or {})}
    for key, value in (drafters or {}).items():
        entry["drafters"][key] = {drafter_option(key): value, "source": "--drafter on the command line"}
    new_tokens = max_new_tokens or preset["max_new_tokens"]
    if new_tokens is None:
        raise SpecbenchError(f"preset {name}: {preset.get('max_new_tokens_source', 'max new tokens not stated')}")
    temperatures = [float(t) for t in preset["temperatures"]] if temperature is None else [float(temperature)]
    benches = [_bench_plan(spec, data_dir, limit) for spec in preset["benches"]]
    runnable, skipped = _sides(preset, entry)
    skipped += [(u["method"], u["reason"]) for u in preset.get("unavailable") or []]
    extra: dict = {}
    for field_name, value in (("chat_template_kwargs", entry.get("chat_template_kwargs") or {}),
                              ("chat_template", preset.get("chat_template")),
                              ("target_revision", target_revision or entry.get("revision"))):
        if not value:
            continue
        if _supported(field_name):
            extra[field_name] = value
        else:
            notes.append(f"{field_name}={value} is part of the protocol but this specbench cannot pass it yet")
    out = Path(out_dir)
    runs: list[PresetRun] = []
    target_name = Path(target.rstrip("/")).name
    all_sides: list[SidePlan] = []
    for bench in benches:
        if bench.unavailable or not bench.prompts:
            continue
        sides = [s for m in runnable for s in _side_plans(m, bench.bench, entry["id"])]
        all_sides += [s for s in sides if s.label not in {a.label for a in all_sides}]
        for temp in temperatures:
            common = dict(target=target, dtype=dtype or preset.get("dtype", "bfloat16"), device=device,
                          temperature=temp, max_new_tokens=new_tokens, bench=bench.bench, prompts=bench.prompts,
                          resume=resume, overwrite=overwrite, preset=name, engine=engine, **extra)
            stem = f"{name}_{bench.bench}_{target_name}_T{temp:g}"
            if sides:
                cfg = RunConfig(sides=[s.side for s in sides], out=str(out / f"{stem}.jsonl"), **common)
                runs.append(PresetRun(cfg, bench.bench, temp, sides))
            for attn in preset.get("baseline_attn") or []:
                if attn == "sdpa" and sides:
                    continue  # the run above already holds the SDPA vanilla side
                if engine == "compiled" and attn in ("flash", "flash_attention_2"):
                    note = f"the {attn} baselines run with --engine eager only (the compiled engine runs SDPA)"
                    if note not in notes:
                        notes.append(note)
                    continue
                # Methods the paper also times under this attention (``attn`` in the method entry) run beside
                # vanilla in one file, named <label>-<attn> so the report keeps them apart from the SDPA rows.
                also_here = [SidePlan(dataclasses.replace(s.side, name=f"{s.side.stem}-{ATTN_TAGS.get(attn, attn)}"),
                                      s.source)
                             for m in runnable if attn in (m.get("attn") or ["sdpa"])
                             for s in _side_plans(m, bench.bench, entry["id"])]
                all_sides += [s for s in also_here if s.label not in {a.label for a in all_sides}]
                if also_here:
                    cfg = RunConfig(sides=[s.side for s in also_here], attn_implementation=attn,
                                    out=str(out / f"{stem}_{attn}.jsonl"), **common)
                    runs.append(PresetRun(cfg, bench.bench, temp, also_here))
                    continue
                cfg = RunConfig(sides=[Side(BASELINE)], baseline="none", attn_implementation=attn,
                                out=str(out / f"{stem}_vanilla-{attn}.jsonl"), **common)
                runs.append(PresetRun(cfg, bench.bench, temp, [SidePlan(Side(BASELINE), "")]))
    if resume:  # each run resumes its own file where it has one; a run not begun yet starts
        for run in runs:
            run.cfg.resume = has_records(Path(run.cfg.out))
        if runs and not any(run.cfg.resume for run in runs):
            raise SpecbenchError(f"nothing to resume: none of preset {name}'s results files exists in {out}; drop "
                                 "--resume")
    return Plan(preset, target, entry, benches, all_sides, skipped, runs, new_tokens, temperatures, notes)


# ------------------------------------------------------------------------------------------- dry run

def _fmt_options(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items()) or "(defaults)"


def estimated_forwards(plan: Plan, run: PresetRun) -> list[tuple[str, str, int, float | None]]:
    """(side's stem, side's label, upper bound on decode target forwards, expected with the paper's tau or None)
    per side.
    Upper bound: every turn runs to max_new_tokens and each forward commits one token (tau = 1)."""
    bench = next(b for b in plan.benches if b.bench == run.bench)
    upper = bench.turns * plan.max_new_tokens
    taus = (plan.target_entry.get("paper_tau") or {}).get(f"{run.temperature:.1f}", {})
    rows = []
    sides = [s.side for s in run.sides] + ([Side(BASELINE)] if run.cfg.baseline == BASELINE else [])
    for side in sides:
        tau = taus.get(side.stem)
        rows.append((side.stem, side.label, upper, upper / tau if tau else None))
    return rows


def _grouped(sides: list[SidePlan]) -> list[tuple[str, list[SidePlan]]]:
    """Sides grouped by their label's stem (a sweep's sides share one), in order."""
    groups: dict[str, list[SidePlan]] = {}
    for s in sides:
        groups.setdefault(s.side.stem, []).append(s)
    return list(groups.items())


def _swept_key(group: list[SidePlan]) -> str | None:
    return group[0].side.shown[0] if len(group) > 1 and group[0].side.shown else None


def _temperatures_source(plan: Plan) -> str:
    """Where the plan's temperatures come from: the preset's source, or --temperature in place of the preset's."""
    theirs = [float(t) for t in plan.preset["temperatures"]]
    if plan.temperatures == theirs:
        return plan.preset.get("temperatures_source", "")
    return f"--temperature, in place of the preset's {', '.join(f'{t:g}' for t in theirs)}"


def format_plan(plan: Plan) -> str:
    p = plan.preset
    lines = [f"preset {p['name']}: {p['title']}",
             f"  paper: {p.get('paper', '')}; code: {p.get('code', '')}",
             f"  target: {plan.target} (revision {plan.target_entry.get('revision') or 'not pinned'})",
             f"  chat template kwargs: {plan.target_entry.get('chat_template_kwargs') or {}}"
             + (f"; template {p['chat_template']}" if p.get("chat_template") else ""),
             f"  max new tokens: {plan.max_new_tokens}  [{p.get('max_new_tokens_source', '')}]",
             f"  temperatures: {', '.join(f'{t:g}' for t in plan.temperatures)}  [{_temperatures_source(plan)}]",
             f"  dtype: {plan.runs[0].cfg.dtype if plan.runs else p.get('dtype')}  [{p.get('dtype_source', '')}]",
             f"  paper metric: {p['metric']['name']}: {p['metric']['description']}  [{p['metric'].get('source', '')}]"]
    if p.get("variant_of"):
        lines.append(f"  variant of {p['variant_of']}: its settings where this variant changes them")
    if p.get("variant_names"):
        lines.append(f"  variants: {', '.join(p['variant_names'])} (run with that name)")
    if p.get("baseline_attn"):
        lines.append(f"  vanilla baselines: {', '.join(p['baseline_attn'])} (the faster counts)  "
                     f"[{p.get('baseline_attn_source', '')}]")
    lines.append("benches:")
    for b in plan.benches:
        if b.unavailable:
            lines.append(f"  {b.bench}: paper n={b.wanted}; NOT RUN: {b.unavailable}  [{b.source}]")
            continue
        lines.append(f"  {b.bench}: {len(b.prompts)} prompts, {b.turns} turns ({b.selection}; paper n={b.wanted})  "
                     f"[{b.source}]")
        lines += [f"    note: {n}" for n in b.notes]
    lines.append("methods:")
    for base, group in _grouped(plan.sides):
        swept, first = _swept_key(group), group[0].side
        opts = {k: ("|".join(str(s.side.options[k]) for s in group) if k == swept else v) for k, v in first.options.items()}
        name = f"{base}@{swept}=*" if swept else base
        lines.append(f"  {name}: {first.method} {_fmt_options(opts)}  [{group[0].source}]")
    for d_name, d in plan.target_entry.get("drafters", {}).items():
        if d.get("train") and not {k for k in d if k not in _ENTRY_META}:
            continue
        where = next((d[k] for k in d if k not in _ENTRY_META), "")
        lines.append(f"  drafter {d_name}: {where} @ {d.get('revision') or 'main (no revision pinned)'}  "
                     f"[{d.get('source', '')}]")
    for label, why in plan.skipped:
        lines.append(f"  NOT RUN {label}: {why}")
    lines.append(f"runs ({len(plan.runs)} results files):")
    total_upper = total_expected = 0.0
    for run in plan.runs:
        attn = f" attn={run.cfg.attn_implementation}" if run.cfg.attn_implementation != "sdpa" else ""
        lines.append(f"  {run.cfg.out}  ({run.bench}, T={run.temperature:g}{attn}, baseline {run.cfg.baseline})")
        estimates = estimated_forwards(plan, run)
        for _, _, upper, expected in estimates:
            total_upper += upper
            total_expected += expected if expected else upper
        by_base: dict[str, list] = {}
        for stem, _, upper, expected in estimates:
            by_base.setdefault(stem, []).append((upper, expected))
        for base, rows in by_base.items():
            upper, expected = rows[0]
            each = f" ({len(rows)} sides, each)" if len(rows) > 1 else ""
            guess = f", ~{expected:,.0f} at the paper's tau {upper / expected:.2f}" if expected else ""
            lines.append(f"    {base}{each}: <= {upper:,} target decode forwards{guess}")
    lines.append(f"estimated target decode forwards: <= {total_upper:,.0f} (upper bound: tau = 1 and no early EOS); "
                 f"~{total_expected:,.0f} with the paper's tau where it gives one (upper bound elsewhere)")
    lines += [f"note: {n}" for n in plan.notes]
    if p.get("warmup_note"):
        lines.append(f"note: {p['warmup_note']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- running

def planned_runs(plan: Plan, here: bool = True) -> list:
    """Each run planned as `specbench run` plans it (``plan.plan_run``: every method option parsed, every
    refusal made), all before the first one starts; `--dry-run` calls it with ``here=False`` (the device and
    attention are the machine's business that runs it)."""
    from specbench.run.plan import plan_run

    return [plan_run(run.cfg, here) for run in plan.runs]


def execute(plan: Plan, console) -> list[Path]:
    """Run every planned config as an ordinary `specbench run`; returns the results files."""
    from specbench.run.runner import Runner, summary_table

    outs = []
    for run, planned in zip(plan.runs, planned_runs(plan)):
        runner = Runner(planned, console)
        records = runner.run()
        console.print(summary_table(records, run.temperature))
        outs.append(runner.store.path)
    return outs
