"""The steps every trainer shares: the target and its regenerated answers, the recipe, and the fit
(held-out split, the shared Trainer, eval.json and the model card)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import typer

from specbench.data.results import hardware
from specbench.training.checks import prompt_file
from specbench.training.learning_curve import curve_points, read_log, write_learning_curve
from specbench.training.model_card import write_model_card
from specbench.training.trainer import Recipe, Trainer


def load_target(target: str, dtype: str, device: str = "auto"):
    """The target on this process's device (``auto``: CUDA when there, else the CPU; a bad device is
    one line before anything loads); under torchrun ``cuda:LOCAL_RANK`` for CUDA (joining the
    process group first; rank 0 fills any model cache first)."""
    from specbench.data import distributed
    from specbench.engine.devices import resolve_device
    from specbench.engine.target import Target

    device = resolve_device(device)
    world = distributed.init(device)
    with distributed.main_first():
        return Target.load(target, dtype, distributed.rank_device(device, world))


def load_data(target, prompts: Optional[str], data_dir: Optional[str], limit: Optional[int], max_new_tokens: int,
              batch_size: int, temperature: float, max_prompt_tokens: int = 512):
    """(cache file, examples): the target's answers to the prompts, regenerated where missing."""
    from specbench.data.benchmarks import load_benchmark
    from specbench.training.data import (dataset_path, import_responses, read_examples, regenerate,
                                         shipped_responses_for)

    file = prompt_file(prompts, data_dir)
    out = dataset_path(target, file, max_new_tokens, temperature)
    items = load_benchmark(str(file), limit=limit)
    shipped = shipped_responses_for(target, file, max_new_tokens, temperature)
    if shipped is not None:  # answers already generated for these prompts: only the prompts are rendered
        from specbench.data import distributed

        with distributed.main_first():  # rank 0 writes the cache; the others then find every id done
            import_responses(target, items, shipped, out)
    regenerate(target, items, out, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
               max_prompt_tokens=max_prompt_tokens)
    wanted = {p.id for p in items}
    return out, [e for e in read_examples(out) if e["id"] in wanted and len(e["prompt_ids"]) <= max_prompt_tokens]


def training_data(options):
    """(target, data file, greedy answers regenerated if missing). The frozen target runs in the
    training dtype: under ``--dtype bfloat16`` its taps come from a bf16 forward (4-5x faster on
    CPUs with AMX and on GPUs) and are cast to fp32 for the drafter."""
    t = load_target(options.target, options.dtype, options.device)
    data_file, examples = load_data(t, options.prompts, options.data_dir, options.limit, options.max_new_tokens, 8,
                                    0.0, options.max_prompt_tokens)
    torch.manual_seed(0)  # the same initial drafter on every run of a command, so a rerun continues the same run
    return t, data_file, examples


def recipe_for(options, max_length: int | None = None, **extra) -> Recipe:
    """The shared recipe from a trainer's options (learning rate, epochs, batch, length, dtype and the
    evaluation spacing); ``extra`` (method settings) is recorded with the checkpoint."""
    return Recipe(lr=options.lr, epochs=options.epochs, max_steps=options.max_steps, batch_size=options.batch_size,
                  max_length=options.max_length if max_length is None else max_length, grad_clip=0.5,
                  eval_every=options.eval_every, save_every=50, dtype=options.dtype, extra=extra)


def note_processes(recipe: Recipe) -> None:
    """Record a data-parallel run's process count with the recipe (the global batch is unchanged)."""
    from specbench.data import distributed

    if distributed.current().active:
        recipe.extra["processes"] = distributed.current().size


# batches(items, epoch, world): one pass; epoch None = the held-out pass (no shuffle, one process).
Batches = Callable[[list, Optional[int], object], Iterator]


def held_out_split(items: list, held_out: float, seed: int) -> tuple[list, list]:
    """(training items, held-out items): ``items`` shuffled in place with ``seed``, then at least one held out."""
    random.Random(seed).shuffle(items)
    n_eval = max(1, int(len(items) * held_out))
    return items[n_eval:], items[:n_eval]


def fit(module, loss_fn, items: list, batches: Batches, save: Callable[[Path], None], recipe: Recipe, out: Path,
        held_out: float, data_file: Path, describe: Callable[[list, list], dict] | None = None,
        card: Callable[[Path, dict], object] = write_model_card, saved: str = "drafter") -> dict:
    """Shuffle ``items`` (seeded), split off the held-out share, train with the shared Trainer (under
    torchrun each rank takes its rows of every batch; rank 0 evaluates and saves), then write
    eval.json and the model card. ``describe(train, held_out)`` adds data statistics to the recipe."""
    trains, evals = held_out_split(items, held_out, recipe.seed)
    recipe.extra.update({"data": str(data_file), "train_examples": len(trains), "eval_examples": len(evals),
                         **(describe(trains, evals) if describe else {})})
    note_processes(recipe)
    recipe.extra["hardware"] = hardware(next(module.parameters()).device)  # the model card says what trained it
    for p in module.parameters():  # trained weights and their optimizer state stay fp32 (bf16 is autocast)
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    trainer = Trainer(module, loss_fn, recipe, out, save=save)
    world = trainer.world
    bs = recipe.batch_size
    steps_per_epoch = (len(trains) + bs - 1) // bs
    final = trainer.fit(lambda epoch: batches(trains, epoch, world), steps_per_epoch, lambda: batches(evals, None, None))
    if world.main:
        folder = Path(out) / "drafter"
        (folder / "eval.json").write_text(json.dumps(final, indent=2) + "\n")
        # Logs written before tokens were counted: the mean tokens per step stands in.
        per_step = recipe.extra.get("train_response_tokens", 0) / max(steps_per_epoch, 1)
        write_learning_curve(folder, curve_points(read_log(trainer.log_path), per_step or None))
        card(folder, final)
        typer.echo(f"held-out: {json.dumps(final)}; {saved} in {folder}")
    return final


def fit_features(target, examples: list[dict], module, loss_fn, taps: list[int], save: Callable[[Path], None],
                 recipe: Recipe, options, data_file: Path) -> dict:
    """``fit`` over TrainBatches of regenerated examples with the target's ``taps`` (on the fly, or
    from the fp16 feature cache with ``options.cache_features``)."""
    from specbench.engine.packaged import cache_dir
    from specbench.training.features import FeatureCache, iterate_batches

    length = recipe.max_length
    recipe.extra["target_dtype"] = str(target.dtype).removeprefix("torch.")
    cache = (FeatureCache(cache_dir() / "features" / data_file.stem, taps, length, target.dtype)
             if options.cache_features else None)

    def batches(items, epoch, world):
        if epoch is None:
            return iterate_batches(target, items, taps, recipe.batch_size, length, shuffle=False, cache=cache)
        return iterate_batches(target, items, taps, recipe.batch_size, length, seed=epoch, cache=cache, world=world)

    return fit(module, loss_fn, examples, batches, save, recipe, options.out, options.held_out, data_file,
               describe=lambda trains, evals: {"train_response_tokens": sum(len(e["response_ids"]) for e in trains)})
