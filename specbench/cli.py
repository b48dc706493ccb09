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
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specbench import interrupt
from specbench.errors import SpecbenchError
from specbench.training.cli import train_app

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fair, lossless benchmarking of speculative-decoding drafters.")
list_app = typer.Typer(no_args_is_help=True, help="List methods, benchmarks or models.")
app.add_typer(list_app, name="list")
app.add_typer(train_app, name="train")
# Tables stay readable when piped (rich assumes 80 columns off a terminal).
console = Console(width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True)


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
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise SpecbenchError(f"config file {config} is not valid YAML ({getattr(exc, 'problem', None) or 'syntax error'}"
                             f"{at}); fix it") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
        raise SpecbenchError(f"config file {config} must hold a mapping of option names to values "
                             f"(got {type(loaded).__name__}), e.g. gamma: 5")
    return loaded


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


@app.command()
def run(
    method: str = typer.Option(..., "--method", "-m", help="Method name (see `specbench list methods`)."),
    bench: str = typer.Option(..., "--bench", "-b", help="Benchmark name or a .jsonl file."),
    target: str = typer.Option("smollm2-135m", help="Target: smollm2-135m, a .gguf file, a model folder or a hub id."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples (lossless either way)."),
    top_k: int = typer.Option(0, help="Top-k filter at T > 0 (0 = off)."),
    top_p: float = typer.Option(1.0, help="Top-p filter at T > 0 (1 = off)."),
    max_new_tokens: int = typer.Option(128, help="New tokens per turn (cut at EOS)."),
    limit: Optional[int] = typer.Option(None, help="First N prompts."),
    sample: Optional[int] = typer.Option(None, help="N prompts drawn with --seed (deterministic)."),
    category: Optional[str] = typer.Option(None, help="Category (spec_bench, mt_bench) or pair (wmt23)."),
    seed: int = typer.Option(0, help="Seed for --sample and for sampling at T > 0."),
    baseline: str = typer.Option("vanilla", help="vanilla (interleaved, same process) or none."),
    out: Optional[Path] = typer.Option(None, help="Results file (default results/<method>_<bench>_<target>_T<t>.jsonl)."),
    resume: bool = typer.Option(False, help="Continue an interrupted run in --out, skipping finished turns."),
    overwrite: bool = typer.Option(False, help="Replace an existing results file."),
    opt: list[str] = typer.Option([], "--opt", help="Method option key=value (repeatable)."),
    config: Optional[Path] = typer.Option(None, help="YAML/JSON file of method options."),
    label: Optional[str] = typer.Option(None, help="Method label in records and tables (default: method name)."),
    dtype: str = typer.Option("bfloat16", help="float32 for exactness checks, bfloat16 for speed."),
    device: str = typer.Option("cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu", help="cpu or cuda."),
    attn: str = typer.Option("sdpa", help="Attention implementation of the target: sdpa or eager."),
    data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files (else $SPECBENCH_DATA)."),
    system_prompt: Optional[str] = typer.Option(None, help="System prompt for the chat template."),
    on_long_prompt: str = typer.Option("skip", help="skip (with a warning) or fail on prompts past the context."),
    warmup: bool = typer.Option(True, help="Run and discard one short generation per side first."),
    sweep: Optional[str] = typer.Option(None, help="key=v1,v2,...: one side per value, labelled METHOD@key=v."),
    also: list[str] = typer.Option([], "--also", help="Another method in the same run: name or name@key=value[@key=value] (repeatable)."),
    passes: int = typer.Option(1, help="Repeat the query stream N times (drafters that learn keep their state)."),
) -> None:
    """Run METHOD (and every --also / --sweep side) on BENCH with the vanilla baseline interleaved
    prompt by prompt; print the summary table. BENCH may be a mixed stream: `mixed` or `a+b+c`."""
    from specbench.runner import RunConfig, Runner, summary_table

    cfg = RunConfig(method=method, bench=bench, options=_parse_opts(opt, config), label=label, target=target,
                    dtype=dtype, device=device, attn_implementation=attn, temperature=temperature, top_k=top_k,
                    top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, baseline=baseline, limit=limit,
                    sample=sample, category=category, data_dir=data_dir, system_prompt=system_prompt,
                    on_long_prompt=on_long_prompt, out=str(out) if out else None, resume=resume,
                    overwrite=overwrite, warmup=warmup, sweep=sweep, also=list(also), passes=passes)
    runner = Runner(cfg, err)
    records = runner.run()
    console.print(summary_table(records, temperature))
    if runner.skipped:
        err.print(f"[yellow]skipped {len(runner.skipped)} prompt(s) past the context window[/]")
    console.print(f"records: {runner.store.path}")


@list_app.command("methods")
def list_methods() -> None:
    """Registered drafting methods (entry-point group specbench.methods)."""
    from specbench.drafter import available_methods

    table = Table("method", "implementation")
    for name, where in available_methods().items():
        table.add_row(name, where)
    console.print(table)


@list_app.command("benches")
def list_benches(data_dir: Optional[str] = typer.Option(None, help="Folder of benchmark JSONL files.")) -> None:
    """Benchmarks, their expected size, and the source each would load from."""
    from specbench.benchmarks import data_dir as resolve_dir, list_benchmarks, resolve_source

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
    from specbench.target import DEFAULT_TARGET, embedded_gguf

    table = Table("target", "where", "status")
    try:
        table.add_row(DEFAULT_TARGET, str(embedded_gguf(DEFAULT_TARGET)), "installed (default)")
    except SpecbenchError as exc:
        table.add_row(DEFAULT_TARGET, "-", str(exc))
    table.add_row("<path>.gguf", "a GGUF file", "loaded through transformers + gguf")
    table.add_row("<folder>", "a Hugging Face model folder", "config.json + weights")
    table.add_row("<org/name>", "a Hugging Face hub id", "needs network or a local HF cache")
    console.print(table)


@app.command()
def report(
    results: list[str] = typer.Argument(None, help="Result files or globs (default results/*.jsonl)."),
    out_dir: Path = typer.Option(Path("reports"), help="Where tables and figures go."),
    show: bool = typer.Option(False, help="Print the main table to the console."),
) -> None:
    """Regenerate the paper-style tables and figures from run records."""
    from specbench import report as rep

    sources = results or ["results/*.jsonl"]
    written = rep.write_report(sources, out_dir=out_dir)
    if show:
        console.print(rep.rich_main_table(sources))
    console.print(f"report: {len(written)} files in {out_dir}/ (open {out_dir}/index.html)")


def _interrupted_line(exc: interrupt.Interrupted) -> str:
    """One line: what was kept and the exact command that continues."""
    signal_name = exc.args[0]
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        return f"interrupted ({signal_name}); checkpoint saved; resume with: {interrupt.resume_command(flag='')}"
    kept = getattr(exc, "kept", None)
    what = f"{signal_name}; finished records kept in {kept}" if kept else signal_name
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


def main() -> None:
    warnings.filterwarnings("ignore", message=".*GGUF.*")
    # Runs and trainings stop at their next step boundary on Ctrl-C / SIGTERM; other commands stop at once.
    graceful = sys.argv[1:2] == ["run"] or (sys.argv[1:2] == ["train"] and sys.argv[2:3] != ["data"])
    try:
        with interrupt.graceful() if graceful else contextlib.nullcontext():
            code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.TyperException as exc:  # click's usage errors: one line, not a usage box
        _usage_error(exc)
    except SpecbenchError as exc:
        err.print(f"[red]error:[/] {_one_line(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except OSError as exc:  # a path the system refuses (name too long, ...) that no check above caught
        if exc.filename is None:
            raise
        err.print(f"[red]error:[/] {_one_line(f'{exc.filename}: {exc.strerror}')}; pass another path",
                  highlight=False, soft_wrap=True)
        sys.exit(2)
    except interrupt.Interrupted as exc:
        err.print(_one_line(_interrupted_line(exc)), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        err.print("interrupted; rerun with --resume to continue")
        sys.exit(130)


if __name__ == "__main__":
    main()
