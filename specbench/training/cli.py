"""`specbench train ...`: regenerate data with the target (`data`), and one command per registered
method that declares a trainer (``Drafter.trainer``, see ``training/plugin.py``), built from its
options dataclass: the core names no method."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from specbench import commands, options as opts
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
    fields = [declared[f.name] for f in option_fields(trainer)]

    def train(**values) -> None:
        run_trainer(trainer, values)

    app = typer.Typer(add_completion=False)
    app.command(name)(commands.command(train, fields, inspect.getdoc(trainer) or f"Train a {name} drafter."))
    return typer.main.get_command(app)


def run_trainer(trainer, values: dict) -> dict:
    """Check ``values`` (flag name -> value) before anything loads, then train."""
    options = trainer.Options(**commands.values_for(trainer.Options, values))
    method = trainer()
    # a trainer that does not derive from MethodTrainer (a plugin's own class) may have no command name
    opts.validate(options, f"train {getattr(trainer, 'command', '') or 'drafter'}", commands.label(trainer.Options))
    check_options(vars(options), then=lambda: method.check(options))
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


@dataclass
class DataOptions:
    """`specbench train data`: the target's answers to the training prompts; the options it shares with the
    trainers are theirs (``TrainOptions``), declared once."""

    target: str = opts.like(TrainOptions, "target", help="Target whose answers are the training data.")
    prompts: Optional[str] = opts.like(TrainOptions, "prompts")
    data_dir: Optional[str] = opts.like(TrainOptions, "data_dir")
    limit: Optional[int] = opts.like(TrainOptions, "limit", default=None, help="First N prompts.")
    max_new_tokens: int = opts.like(TrainOptions, "max_new_tokens", default=256, help="Response length cap.")
    batch_size: int = opts.like(TrainOptions, "batch_size", default=8, help="Prompts per generate call.")
    temperature: float = opts.option(0.0, "0 = greedy (default), else sampled.", ge=0, note="0 is greedy")
    dtype: str = opts.option("bfloat16", "Target dtype for generation (auto: bfloat16 where it is native, else "
                                         "float32).", check="specbench.engine.target:check_dtype")
    max_prompt_tokens: int = opts.like(TrainOptions, "max_prompt_tokens")
    export: Optional[str] = opts.option(None, "Also write the responses (no prompt text) to this .responses.jsonl.gz, "
                                              "to ship under specbench/training/responses/<target>/.",
                                        cli_type=Optional[Path], convert=commands.path_text)
    device: str = opts.like(TrainOptions, "device")


def _data(**flags) -> None:
    """Answer the prompts with the target (resumable; under torchrun each rank answers its share);
    prints where the data is cached."""
    o = commands.build(DataOptions, flags, "train data")
    check_options(vars(o))
    target, prompts, data_dir, export = o.target, o.prompts, o.data_dir, o.export
    max_new_tokens, temperature, max_prompt_tokens = o.max_new_tokens, o.temperature, o.max_prompt_tokens
    from specbench.data import distributed
    from specbench.training.checkpoint import vocab_fingerprint
    from specbench.training.data import _prompt_digest, export_responses
    from specbench.training.fit import load_data, load_target

    if export is not None:  # refused before the target loads: the prompts, a device, a FIFO, a symlink
        from specbench.data.safe_files import check_output

        check_output(Path(export), [("--prompts", prompts), ("--prompts", prompt_file(prompts, data_dir)),
                                    ("--target", target)], what="--export")
    t = load_target(target, training_dtype(o.dtype, o.device), o.device)
    out, examples = load_data(t, prompts, data_dir, o.limit, max_new_tokens, o.batch_size, temperature,
                              max_prompt_tokens)
    tokens = sum(len(e["response_ids"]) for e in examples)
    if not distributed.current().main:
        return
    typer.echo(f"{len(examples)} examples, {tokens} response tokens -> {out}")
    if export is not None:
        file = prompt_file(prompts, data_dir)
        export_responses(out, Path(export), target=t.name, vocab=vocab_fingerprint(t.tokenizer),
                         prompt_file=file.name, prompt_digest=_prompt_digest(file), max_new_tokens=max_new_tokens,
                         temperature=temperature, max_prompt_tokens=max_prompt_tokens, dtype=str(t.dtype),
                         device=str(t.device))
        typer.echo(f"responses -> {export}")


train_app.command("data")(commands.command(_data, commands.flags_of(DataOptions)))
