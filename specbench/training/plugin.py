"""The trainer protocol: how a method trains its drafter, so that `specbench train` needs no
per-method code.

A method's Drafter class names its trainer (``Drafter.trainer``: a ``MethodTrainer`` subclass, or a
``"module:Class"`` reference imported only when `specbench train` needs it). A trainer declares

- ``Options``: a dataclass extending ``TrainOptions`` (the options every trainer shares) with its
  own fields, declared with ``specbench.options.option`` (help and range) like a method's options;
  a field redeclared only to change its default keeps the shared help and range; the command line
  is built from these fields (``--draft-vocab`` from ``draft_vocab``, bools as ``--x/--no-x``);
- ``command``: the `specbench train COMMAND` name ("" = the method's registered name);
- ``omit``: shared options it does not take (no flag; the field keeps its default);
- ``check(options)``: checks no field rule can say (one ``SpecbenchError`` line), run before the
  target loads;
- ``train(options)``: load data, build, fit and save (``specbench.training.fit`` has the shared steps).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from specbench.engine import DEFAULT_TARGET
from specbench.options import data_dir_option, device_option, option

__all__ = ["MethodTrainer", "TrainOptions", "option", "option_fields", "registered_trainers", "trainer_of"]


@dataclass
class TrainOptions:
    """Options every drafter-training command takes (a trainer may change their defaults)."""

    out: Path = option(help="Folder to write the drafter to.")
    target: str = option(DEFAULT_TARGET, "Target the drafter is trained for.")
    prompts: Optional[str] = option(None, "Prompt JSONL (default: <data dir>/train_prompts/sharegpt_first_turns.jsonl).")
    data_dir: Optional[str] = data_dir_option()
    limit: Optional[int] = option(400, "Training prompts.", ge=1)
    max_new_tokens: int = option(128, "Response length cap when regenerating.", ge=1)
    epochs: int = option(3, "Passes over the training data.", ge=1)
    max_steps: Optional[int] = option(None, "Train exactly N optimizer steps instead (the cosine schedule spans N; "
                                            "overrides --epochs).", ge=1)
    lr: float = option(1e-3, "Peak learning rate (AdamW, cosine schedule with warmup).", gt=0)
    batch_size: int = option(8, "Examples per optimizer step.", ge=1)
    max_length: int = option(384, "Training sequence length (prompt + response).", ge=1)
    held_out: float = option(0.05, "Share of examples kept for evaluation.", ge=0, lt=1)
    eval_every: int = option(100, "Evaluate on the held-out share every N optimizer steps (and at the end); "
                                  "each evaluation is a point of the learning curve.", ge=1)
    cache_features: bool = option(True, "Cache target taps to disk (fp16) after the first epoch.")
    max_prompt_tokens: int = option(512, "Skip prompts longer than this (rendered).", ge=1)
    dtype: str = option("float32", "float32, or bfloat16: the frozen target's taps come from a bf16 forward and "
                                   "the drafter trains under autocast (its weights and optimizer state stay fp32); "
                                   "several times faster on CPUs with native bf16 and on GPUs, several times slower "
                                   "on CPUs without it; auto picks bfloat16 where it is native, else float32.")
    device: str = device_option()


class MethodTrainer:
    """Base class of a method's trainer (see the module docstring); its docstring is the command's help."""

    command: ClassVar[str] = ""
    Options: ClassVar[type[TrainOptions]] = TrainOptions
    omit: ClassVar[tuple[str, ...]] = ()

    def check(self, options: TrainOptions) -> None:
        """Method-specific checks, before anything loads."""

    def train(self, options: TrainOptions) -> dict:
        """Train and save under ``options.out``/drafter; returns the held-out evaluation."""
        raise NotImplementedError


def trainer_of(method: type) -> type[MethodTrainer] | None:
    """The trainer class a Drafter class declares (importing a ``"module:Class"`` reference), or None."""
    ref = getattr(method, "trainer", None)
    if ref is None or ref == "":
        return None
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        ref = getattr(importlib.import_module(module), attr)
    return ref


def registered_trainers() -> dict[str, type[MethodTrainer]]:
    """command name -> trainer for every registered method that declares one. Methods sharing a
    trainer (variants, subclasses) give one command, named by the trainer's ``command`` or else by
    the method that declares it. A method that fails to import is skipped with a warning, so one
    broken plugin does not take every other trainer down."""
    from specbench.engine.registry import available_methods, method_class

    users: dict[type, list[tuple[str, bool]]] = {}
    for name in available_methods():
        try:
            cls = method_class(name)
            trainer = trainer_of(cls)
        except Exception as exc:  # a third-party plugin's import error
            warnings.warn(f"method {name!r} could not be loaded to find its trainer ({type(exc).__name__}: {exc})")
            continue
        if trainer is not None:
            users.setdefault(trainer, []).append((name, "trainer" in vars(cls)))
    commands: dict[str, type[MethodTrainer]] = {}
    for trainer, names in users.items():
        declaring = [n for n, declares in names if declares] or [names[0][0]]
        commands.setdefault(trainer.command or declaring[0], trainer)
    return dict(sorted(commands.items()))


def option_fields(trainer: type[MethodTrainer]) -> list[dataclasses.Field]:
    """The trainer's flags in command-line order: out, target, its own options, then the shared ones."""
    shared = {f.name for f in dataclasses.fields(TrainOptions)}
    fields = [f for f in dataclasses.fields(trainer.Options) if f.name not in trainer.omit]
    head = [f for f in fields if f.name in ("out", "target")]
    own = [f for f in fields if f.name not in shared]
    rest = [f for f in fields if f.name in shared and f.name not in ("out", "target")]
    return head + own + rest
