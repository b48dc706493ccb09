"""`specbench train ...`: regenerate data with the target, then train a drafter for it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import torch
import typer

from specbench.errors import SpecbenchError

train_app = typer.Typer(no_args_is_help=True, help="Regenerate training data and train drafters.")

# Options every drafter-training command takes, declared once so defaults and help cannot drift.
OUT = typer.Option(..., help="Folder to write the drafter to.")
TARGET = typer.Option("smollm2-135m", help="Target the drafter is trained for.")
PROMPTS = typer.Option(None, help="Prompt JSONL (default: <data dir>/train_prompts/sharegpt_first_turns.jsonl).")
DATA_DIR = typer.Option(None, help="Data folder (else $SPECBENCH_DATA).")
TRAIN_LIMIT = typer.Option(400, help="Training prompts.")
RESPONSE_TOKENS = typer.Option(128, help="Response length cap when regenerating.")
MAX_LENGTH = typer.Option(384, help="Training sequence length (prompt + response).")
HELD_OUT = typer.Option(0.05, help="Share of examples kept for evaluation.")
CACHE_FEATURES = typer.Option(True, help="Cache target taps to disk (fp16) after the first epoch.")
MAX_PROMPT_TOKENS = typer.Option(512, help="Skip prompts longer than this (rendered).")


def _prompt_file(prompts: Optional[str], data_dir: Optional[str]) -> Path:
    from specbench.benchmarks import data_dir as resolve_dir
    from specbench.training.data import DEFAULT_PROMPTS

    if prompts:
        path = Path(prompts)
    else:
        folder = resolve_dir(data_dir)
        if folder is None:
            raise SpecbenchError("no prompt file: pass --prompts FILE.jsonl or set SPECBENCH_DATA to the data folder "
                                 f"holding {DEFAULT_PROMPTS}")
        path = Path(folder) / DEFAULT_PROMPTS
    if not path.is_file():
        raise SpecbenchError(f"prompt file {path} does not exist; pass --prompts FILE.jsonl")
    return path


def _load_data(target, prompts: Optional[str], data_dir: Optional[str], limit: Optional[int], max_new_tokens: int,
               batch_size: int, temperature: float, max_prompt_tokens: int = 512):
    from specbench.benchmarks import load_benchmark
    from specbench.training.data import dataset_path, read_examples, regenerate

    file = _prompt_file(prompts, data_dir)
    out = dataset_path(target, file, max_new_tokens, temperature)
    items = load_benchmark(str(file), limit=limit)
    regenerate(target, items, out, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
               max_prompt_tokens=max_prompt_tokens)
    wanted = {p.id for p in items}
    return out, [e for e in read_examples(out) if e["id"] in wanted and len(e["prompt_ids"]) <= max_prompt_tokens]


def _training_data(target: str, prompts: Optional[str], data_dir: Optional[str], limit: Optional[int],
                   max_new_tokens: int, max_prompt_tokens: int):
    """The target in fp32 (training precision) and its greedy answers, regenerated if missing."""
    from specbench.target import Target

    t = Target.load(target, "float32")
    data_file, examples = _load_data(t, prompts, data_dir, limit, max_new_tokens, 8, 0.0, max_prompt_tokens)
    return t, data_file, examples


@train_app.command("data")
def data(
    target: str = typer.Option("smollm2-135m", help="Target whose answers are the training data."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = typer.Option(None, help="First N prompts."),
    max_new_tokens: int = typer.Option(256, help="Response length cap."),
    batch_size: int = typer.Option(8, help="Prompts per generate call."),
    temperature: float = typer.Option(0.0, help="0 = greedy (default), else sampled."),
    dtype: str = typer.Option("bfloat16", help="Target dtype for generation."),
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> None:
    """Answer the prompts with the target (resumable); prints where the data is cached."""
    from specbench.target import Target

    t = Target.load(target, dtype)
    out, examples = _load_data(t, prompts, data_dir, limit, max_new_tokens, batch_size, temperature, max_prompt_tokens)
    tokens = sum(len(e["response_ids"]) for e in examples)
    typer.echo(f"{len(examples)} examples, {tokens} response tokens -> {out}")


def _fit(target, examples: list[dict], module, loss_fn, taps: list[int], save, out: Path, recipe, held_out: float,
         data_file: Path, cache_features: bool) -> dict:
    """Split off a held-out set, train with the shared Trainer, save, and write eval.json."""
    from specbench.target import cache_dir
    from specbench.training.features import FeatureCache, iterate_batches
    from specbench.training.model_card import write_model_card
    from specbench.training.trainer import Trainer

    random.Random(recipe.seed).shuffle(examples)
    n_eval = max(1, int(len(examples) * held_out))
    evals, trains = examples[:n_eval], examples[n_eval:]
    recipe.extra.update({"data": str(data_file), "train_examples": len(trains), "eval_examples": len(evals),
                         "train_response_tokens": sum(len(e["response_ids"]) for e in trains)})
    bs, length = recipe.batch_size, recipe.max_length
    cache = FeatureCache(cache_dir() / "features" / data_file.stem, taps, length) if cache_features else None
    trainer = Trainer(module, loss_fn, recipe, out, save=save)
    final = trainer.fit(lambda epoch: iterate_batches(target, trains, taps, bs, length, seed=epoch, cache=cache),
                        (len(trains) + bs - 1) // bs,
                        lambda: iterate_batches(target, evals, taps, bs, length, shuffle=False, cache=cache))
    (Path(out) / "drafter" / "eval.json").write_text(json.dumps(final, indent=2) + "\n")
    write_model_card(Path(out) / "drafter", final)
    typer.echo(f"held-out: {json.dumps(final)}; drafter in {Path(out) / 'drafter'}")
    return final


def _recipe(lr: float, epochs: int, batch_size: int, max_length: int, **extra):
    from specbench.training.trainer import Recipe

    return Recipe(lr=lr, epochs=epochs, batch_size=batch_size, max_length=max_length, grad_clip=0.5,
                  eval_every=100, save_every=50, extra=extra)


@train_app.command("sps-student")
def sps_student(
    out: Path = OUT,
    target: str = TARGET,
    layers: str = typer.Option("0,29", help="Target layers copied into the student (comma-separated)."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = TRAIN_LIMIT,
    max_new_tokens: int = RESPONSE_TOKENS,
    epochs: int = typer.Option(4),
    lr: float = typer.Option(3e-4),
    batch_size: int = typer.Option(4),
    max_length: int = MAX_LENGTH,
    held_out: float = HELD_OUT,
    cache_features: bool = CACHE_FEATURES,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> None:
    """Distil a small SpS draft model from the target (KL on target-regenerated responses)."""
    from methods.sps_student import build_student, distillation_loss, save_student

    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens)
    chosen = [int(x) for x in layers.split(",")]
    student = build_student(t, chosen)
    recipe = _recipe(lr, epochs, batch_size, max_length, layers=chosen)
    _fit(t, examples, student, lambda b: distillation_loss(student, b), [-1],
         lambda folder: save_student(folder, student, t, chosen, recipe.__dict__), out, recipe, held_out, data_file,
         cache_features)


@train_app.command("eagle3")
def eagle3(
    out: Path = OUT,
    target: str = TARGET,
    draft_vocab: int = typer.Option(4096, help="Reduced draft vocabulary (most frequent response tokens)."),
    steps: int = typer.Option(7, help="Training-time-test unroll steps."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = TRAIN_LIMIT,
    max_new_tokens: int = RESPONSE_TOKENS,
    epochs: int = typer.Option(4),
    lr: float = typer.Option(1e-3),
    batch_size: int = typer.Option(8),
    max_length: int = MAX_LENGTH,
    held_out: float = HELD_OUT,
    cache_features: bool = CACHE_FEATURES,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> None:
    """Train an EAGLE-3 drafter (training-time test over ``steps`` unrolled steps, 0.8^s decay)."""
    from methods.eagle3 import Eagle3Model
    from specbench.training.features import token_counts
    from specbench.training.vocab import build_vocab_mapping

    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens)
    d2t, t2d, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), draft_vocab)
    typer.echo(f"draft vocabulary {draft_vocab}: {100 * coverage:.2f}% of response tokens")
    model = Eagle3Model.from_target(t, (d2t, t2d))
    recipe = _recipe(lr, epochs, batch_size, max_length, draft_vocab=draft_vocab, vocab_coverage=coverage,
                     unroll_steps=steps)
    _fit(t, examples, model, lambda b: model.training_loss(b, steps=steps), list(model.taps),
         lambda folder: model.save(folder, t, recipe.__dict__), out, recipe, held_out, data_file, cache_features)


@train_app.command("medusa")
def medusa(
    out: Path = OUT,
    target: str = TARGET,
    heads: int = typer.Option(5, help="Medusa heads (head k predicts k+2 tokens ahead)."),
    layers: int = typer.Option(1, help="ResBlocks per head."),
    shared_lm_head: bool = typer.Option(True, help="Reuse the target's frozen lm_head in every head (small checkpoint)."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = TRAIN_LIMIT,
    max_new_tokens: int = RESPONSE_TOKENS,
    epochs: int = typer.Option(2),
    lr: float = typer.Option(1e-3),
    batch_size: int = typer.Option(8),
    max_length: int = MAX_LENGTH,
    held_out: float = HELD_OUT,
    cache_features: bool = CACHE_FEATURES,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> None:
    """Train Medusa-1 heads on the frozen target (sum_k 0.8^k CE of head k vs token k+2 ahead)."""
    from methods.medusa import MedusaHeads, save_medusa

    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens)
    model = MedusaHeads.for_target(t, num_heads=heads, num_layers=layers, shared_lm_head=shared_lm_head)
    recipe = _recipe(lr, epochs, batch_size, max_length, heads=heads, layers=layers, shared_lm_head=shared_lm_head)
    recipe.warmup_ratio = 0.1
    _fit(t, examples, model, model.training_loss, [-1],
         lambda folder: save_medusa(folder, model, t, recipe.__dict__, dtype=torch.bfloat16), out, recipe, held_out,
         data_file, cache_features)
