"""`specbench train ...`: regenerate data with the target (`data`), and one command per registered
method that declares a trainer (``Drafter.trainer``, see ``training/plugin.py``), built from its
options dataclass: the core names no method."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from specbench import options as opts
from specbench.training.checks import check_options, prompt_file
from specbench.training.heap import return_large_frees_to_os
from specbench.training.plugin import TrainOptions


class TrainCommands(TyperGroup):
    """`specbench train`: `data` plus the trainers' commands, built the first time the group's
    commands are read (so other commands do not import every method)."""

    @property
    def commands(self):
        if not self._built:
            self._built = True
            from specbench.training.plugin import registered_trainers

            for name, trainer in registered_trainers().items():
                self._commands.setdefault(name, trainer_command(name, trainer))
        return self._commands

    @commands.setter
    def commands(self, value) -> None:
        self._commands, self._built = value, False


train_app = typer.Typer(cls=TrainCommands, no_args_is_help=True, help="Regenerate training data and train drafters.")


def trainer_command(name: str, trainer):
    """A click command for ``trainer``: one option per field of its options dataclass (type, default
    and help from the field); it checks the values, then calls ``trainer().train(options)``."""
    from specbench.training.plugin import option_fields

    declared = opts.declared_by_name(trainer.Options)
    params = []
    for f in option_fields(trainer):
        option = declared[f.name]
        default = typer.Option(_default(f), help=opts.help_text(option))
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=option.type,
                                        default=default))

    def command(**values) -> None:
        run_trainer(trainer, values)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = inspect.getdoc(trainer) or f"Train a {name} drafter."
    app = typer.Typer(add_completion=False)
    app.command(name)(command)
    return typer.main.get_command(app)


def _default(f: dataclasses.Field):
    """A field's default; ``...`` (a required option) where it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else ...


def run_trainer(trainer, values: dict) -> dict:
    """Check ``values`` (flag name -> value) before anything loads, then train."""
    options = trainer.Options(**values)
    method = trainer()
    check_options(values, opts.declared_by_name(trainer.Options), then=lambda: method.check(options))
    options.dtype = training_dtype(options.dtype, options.device)
    return_large_frees_to_os()
    return method.train(options)


def training_dtype(spec: str, device: str) -> str:
    """The dtype a run trains in: ``auto`` resolved for the device; a warning where bf16 would be emulated."""
    from specbench.engine.devices import choose_dtype, emulated_bf16, resolve_device

    resolved = resolve_device(device)
    dtype, _ = choose_dtype(spec, resolved)
    if dtype == "bfloat16" and emulated_bf16(resolved):
        typer.echo("warning: this CPU has no native bf16 (no avx512_bf16/amx_bf16), so --dtype bfloat16 runs "
                   "several times slower than float32 here; pass --dtype auto or float32", err=True)
    return dtype


# `train data` shares these options' help and ranges with the trainers.
_SHARED = opts.declared_by_name(TrainOptions)
DATA_OPTIONS = {**_SHARED, "temperature": opts.Declared("temperature", float, 0.0, ge=0, note="0 is greedy")}


def _shared(name: str):
    return typer.Option(_SHARED[name].default, help=opts.help_text(_SHARED[name]))


@train_app.command("data")
def data(
    target: str = typer.Option("smollm2-135m", help="Target whose answers are the training data."),
    prompts: Optional[str] = _shared("prompts"),
    data_dir: Optional[str] = _shared("data_dir"),
    limit: Optional[int] = typer.Option(None, help="First N prompts."),
    max_new_tokens: int = typer.Option(256, help="Response length cap."),
    batch_size: int = typer.Option(8, help="Prompts per generate call."),
    temperature: float = typer.Option(0.0, help="0 = greedy (default), else sampled."),
    dtype: str = typer.Option("bfloat16", help="Target dtype for generation (auto: bfloat16 where it is native, "
                                               "else float32)."),
    max_prompt_tokens: int = _shared("max_prompt_tokens"),
    export: Optional[Path] = typer.Option(None, help="Also write the responses (no prompt text) to this "
                                                     ".responses.jsonl.gz, to ship under specbench/training/responses/<target>/."),
    device: str = _shared("device"),
) -> None:
    """Answer the prompts with the target (resumable; under torchrun each rank answers its share);
    prints where the data is cached."""
    check_options(locals(), DATA_OPTIONS)
    from specbench.run import distributed
    from specbench.training.checkpoint import vocab_fingerprint
    from specbench.training.data import _prompt_digest, export_responses
    from specbench.training.fit import load_data, load_target

    if export is not None:  # refused before the target loads: the prompts, a device, a FIFO, a symlink
        from specbench.run.safe_files import check_output

        check_output(export, [("--prompts", prompts), ("--prompts", prompt_file(prompts, data_dir)),
                              ("--target", target)], what="--export")
    t = load_target(target, training_dtype(dtype, device), device)
    out, examples = load_data(t, prompts, data_dir, limit, max_new_tokens, batch_size, temperature, max_prompt_tokens)
    tokens = sum(len(e["response_ids"]) for e in examples)
    if not distributed.current().main:
        return
    typer.echo(f"{len(examples)} examples, {tokens} response tokens -> {out}")
    if export is not None:
        file = prompt_file(prompts, data_dir)
        export_responses(out, export, target=t.name, vocab=vocab_fingerprint(t.tokenizer),
                         prompt_file=file.name, prompt_digest=_prompt_digest(file), max_new_tokens=max_new_tokens,
                         temperature=temperature, max_prompt_tokens=max_prompt_tokens, dtype=str(t.dtype),
                         device=str(t.device))
        typer.echo(f"responses -> {export}")
