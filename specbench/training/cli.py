"""`specbench train ...`: regenerate data with the target, then train a drafter for it."""

from __future__ import annotations

import json
import math
import os
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
DEVICE = typer.Option("auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N.")
TRAIN_DTYPE = typer.Option("float32", help="float32, or bfloat16 (autocast; the weights and optimizer state "
                                           "stay fp32; ~2x faster on CPUs with native bf16 and on GPUs).")


# Every numeric training option and what it must be; checked before the target loads.
_AT_LEAST_ONE = ("epochs", "batch_size", "max_length", "max_new_tokens", "limit", "heads", "steps", "block_size",
                 "window", "anchors", "rank_hidden", "max_prompt_tokens")
_NON_NEGATIVE = ("rank_start", "cross_block_start", "mask_token_id", "draft_vocab")
_FRACTIONS = ("held_out", "cross_fraction")  # in [0, 1)


def _check_options(options: dict) -> None:
    """One line for a bad training option, before anything is loaded or written."""
    from specbench.target import resolve_dtype

    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int) and value > 2**31 - 1:
            raise SpecbenchError(f"{flag} {value} is too large")
        if name in _AT_LEAST_ONE + ("layers",) and isinstance(value, int) and value < 1:
            raise SpecbenchError(f"{flag} must be >= 1 (got {value})")
        if name in _NON_NEGATIVE and value < 0:
            raise SpecbenchError(f"{flag} must be >= 0 (got {value})")
        if isinstance(value, float):
            if not math.isfinite(value):
                raise SpecbenchError(f"{flag} must be a finite number (got {value})")
            if name in _FRACTIONS and not 0 <= value < 1:
                raise SpecbenchError(f"{flag} must be in [0, 1) (got {value})")
            if name in ("lr", "decay") and value <= 0:
                raise SpecbenchError(f"{flag} must be > 0 (got {value})")
            if name == "temperature" and value < 0:
                raise SpecbenchError(f"{flag} must be >= 0 (got {value}); 0 is greedy")
    for name in ("layers", "target_layer_ids"):
        if isinstance(options.get(name), str):
            try:
                ids = [int(x) for x in options[name].split(",") if x.strip()]
            except ValueError:
                raise SpecbenchError(f"--{name.replace('_', '-')} expects comma-separated layer numbers "
                                     f"(got {options[name]!r}), e.g. 0,1") from None
            if any(i < 0 for i in ids) or (name == "layers" and not ids):
                raise SpecbenchError(f"--{name.replace('_', '-')} expects layer numbers >= 0 (got {options[name]!r})")
    if "dtype" in options:
        resolve_dtype(options["dtype"])
    if options.get("normalise") not in (None, "slot", "block"):
        raise SpecbenchError(f"--normalise must be 'slot' or 'block' (got {options['normalise']!r})")
    if options.get("variant") not in (None, *SPECBLOCK_VARIANTS):
        raise SpecbenchError(f"unknown SpecBlock variant {options['variant']!r}; choose from {', '.join(SPECBLOCK_VARIANTS)}")
    if options.get("data_dir"):
        from specbench.benchmarks import check_data_dir_option

        check_data_dir_option(options["data_dir"])
    if "prompts" in options:  # read now: a damaged prompt file fails before the target loads
        from specbench.benchmarks import load_benchmark

        load_benchmark(str(_prompt_file(options["prompts"], options.get("data_dir"))), limit=options.get("limit"))
    out = options.get("out")
    if out is not None:
        _check_writable_folder(Path(out))


def _check_writable_folder(out: Path) -> None:
    try:
        if out.exists() and not out.is_dir():
            raise SpecbenchError(f"--out {out} is a file; pass a folder to write the drafter to")
        existing = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    except OSError as exc:
        raise SpecbenchError(f"--out {out}: {exc.strerror}; pass another folder") from None
    if not os.access(existing, os.W_OK):
        raise SpecbenchError(f"--out {out}: {existing} is not writable; pass a writable folder")


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
    if not os.access(path, os.R_OK):
        raise SpecbenchError(f"prompt file {path} is not readable; check its permissions")
    return path


def _load_data(target, prompts: Optional[str], data_dir: Optional[str], limit: Optional[int], max_new_tokens: int,
               batch_size: int, temperature: float, max_prompt_tokens: int = 512):
    from specbench.benchmarks import load_benchmark
    from specbench.training.data import (dataset_path, import_responses, read_examples, regenerate,
                                         shipped_responses_for)

    file = _prompt_file(prompts, data_dir)
    out = dataset_path(target, file, max_new_tokens, temperature)
    items = load_benchmark(str(file), limit=limit)
    shipped = shipped_responses_for(target, file, max_new_tokens, temperature)
    if shipped is not None:  # answers already generated for these prompts: only the prompts are rendered
        from specbench import distributed

        with distributed.main_first():  # rank 0 writes the cache; the others then find every id done
            import_responses(target, items, shipped, out)
    regenerate(target, items, out, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
               max_prompt_tokens=max_prompt_tokens)
    wanted = {p.id for p in items}
    return out, [e for e in read_examples(out) if e["id"] in wanted and len(e["prompt_ids"]) <= max_prompt_tokens]


def _load_target(target: str, dtype: str, device: str = "auto"):
    """The target on this process's device (``auto``: CUDA when there, else the CPU; a bad device is
    one line before anything loads); under torchrun ``cuda:LOCAL_RANK`` for CUDA (joining the
    process group first; rank 0 fills any model cache first)."""
    from specbench import distributed
    from specbench.devices import resolve_device
    from specbench.target import Target

    device = resolve_device(device)
    world = distributed.init(device)
    with distributed.main_first():
        return Target.load(target, dtype, distributed.rank_device(device, world))


def _training_data(target: str, prompts: Optional[str], data_dir: Optional[str], limit: Optional[int],
                   max_new_tokens: int, max_prompt_tokens: int, device: str = "auto"):
    """The target in fp32 (training precision) and its greedy answers, regenerated if missing."""
    t = _load_target(target, "float32", device)
    data_file, examples = _load_data(t, prompts, data_dir, limit, max_new_tokens, 8, 0.0, max_prompt_tokens)
    torch.manual_seed(0)  # the same initial drafter on every run of a command, so a rerun continues the same run
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
    export: Optional[Path] = typer.Option(None, help="Also write the responses (no prompt text) to this "
                                                     ".responses.jsonl.gz, to ship under training_data/<target>/."),
    device: str = DEVICE,
) -> None:
    """Answer the prompts with the target (resumable; under torchrun each rank answers its share);
    prints where the data is cached."""
    _check_options(locals())
    from specbench import distributed
    from specbench.training.checkpoint import vocab_fingerprint
    from specbench.training.data import _prompt_digest, export_responses

    t = _load_target(target, dtype, device)
    out, examples = _load_data(t, prompts, data_dir, limit, max_new_tokens, batch_size, temperature, max_prompt_tokens)
    tokens = sum(len(e["response_ids"]) for e in examples)
    if not distributed.current().main:
        return
    typer.echo(f"{len(examples)} examples, {tokens} response tokens -> {out}")
    if export is not None:
        file = _prompt_file(prompts, data_dir)
        export_responses(out, export, target=t.name, vocab=vocab_fingerprint(t.tokenizer),
                         prompt_file=file.name, prompt_digest=_prompt_digest(file), max_new_tokens=max_new_tokens,
                         temperature=temperature, max_prompt_tokens=max_prompt_tokens, dtype=str(t.dtype),
                         device=str(t.device))
        typer.echo(f"responses -> {export}")


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
    _note_processes(recipe)
    bs, length = recipe.batch_size, recipe.max_length
    cache = FeatureCache(cache_dir() / "features" / data_file.stem, taps, length) if cache_features else None
    trainer = Trainer(module, loss_fn, recipe, out, save=save)
    world = trainer.world  # under torchrun: this rank's rows of every batch; rank 0 evaluates and saves
    final = trainer.fit(lambda epoch: iterate_batches(target, trains, taps, bs, length, seed=epoch, cache=cache,
                                                      world=world),
                        (len(trains) + bs - 1) // bs,
                        lambda: iterate_batches(target, evals, taps, bs, length, shuffle=False, cache=cache))
    if world.main:
        (Path(out) / "drafter" / "eval.json").write_text(json.dumps(final, indent=2) + "\n")
        write_model_card(Path(out) / "drafter", final)
        typer.echo(f"held-out: {json.dumps(final)}; drafter in {Path(out) / 'drafter'}")
    return final


def _note_processes(recipe) -> None:
    """Record a data-parallel run's process count with the recipe (the global batch is unchanged)."""
    from specbench import distributed

    if distributed.current().active:
        recipe.extra["processes"] = distributed.current().size


def _recipe(lr: float, epochs: int, batch_size: int, max_length: int, dtype: str = "float32", **extra):
    from specbench.training.trainer import Recipe

    return Recipe(lr=lr, epochs=epochs, batch_size=batch_size, max_length=max_length, grad_clip=0.5,
                  eval_every=100, save_every=50, dtype=dtype, extra=extra)


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
    dtype: str = TRAIN_DTYPE,
    device: str = DEVICE,
) -> None:
    """Distil a small SpS draft model from the target (KL on target-regenerated responses)."""
    _check_options(locals())
    from methods.sps_student import build_student, distillation_loss, save_student

    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens, device)
    chosen = [int(x) for x in layers.split(",")]
    student = build_student(t, chosen)
    recipe = _recipe(lr, epochs, batch_size, max_length, dtype=dtype, layers=chosen)
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
    dtype: str = TRAIN_DTYPE,
    device: str = DEVICE,
) -> None:
    """Train an EAGLE-3 drafter (training-time test over ``steps`` unrolled steps, 0.8^s decay)."""
    _check_options(locals())
    from methods.eagle3 import Eagle3Model
    from specbench.training.features import token_counts
    from specbench.training.vocab import build_vocab_mapping

    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens, device)
    d2t, t2d, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), draft_vocab)
    typer.echo(f"draft vocabulary {draft_vocab}: {100 * coverage:.2f}% of response tokens")
    model = Eagle3Model.from_target(t, (d2t, t2d))
    recipe = _recipe(lr, epochs, batch_size, max_length, dtype=dtype, draft_vocab=draft_vocab, vocab_coverage=coverage,
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
    dtype: str = TRAIN_DTYPE,
    device: str = DEVICE,
) -> None:
    """Train Medusa-1 heads on the frozen target (sum_k 0.8^k CE of head k vs token k+2 ahead)."""
    _check_options(locals())
    from methods.medusa import MedusaHeads, save_medusa

    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens, device)
    model = MedusaHeads.for_target(t, num_heads=heads, num_layers=layers, shared_lm_head=shared_lm_head)
    recipe = _recipe(lr, epochs, batch_size, max_length, dtype=dtype, heads=heads, layers=layers, shared_lm_head=shared_lm_head)
    recipe.warmup_ratio = 0.1
    _fit(t, examples, model, model.training_loss, [-1],
         lambda folder: save_medusa(folder, model, t, recipe.__dict__, dtype=torch.bfloat16), out, recipe, held_out,
         data_file, cache_features)


@train_app.command("dflash")
def dflash(
    out: Path = OUT,
    target: str = TARGET,
    layers: int = typer.Option(3, help="Drafter decoder layers."),
    block_size: int = typer.Option(16, help="Block L = bonus + L-1 drafted slots (the tree's maximum depth is L-1)."),
    target_layer_ids: str = typer.Option("", help="Target layers tapped, comma-separated (default: evenly spaced, "
                                                  "one per drafter layer)."),
    mask_token_id: Optional[int] = typer.Option(None, help="MASK id (default: the tokenizer's, else an unused added token)."),
    anchors: int = typer.Option(64, help="Random block anchors per sequence and step (reference: up to 512)."),
    draft_vocab: int = typer.Option(4096, help="Score only the target lm_head's rows of the N most frequent response "
                                               "tokens (0 = the whole vocabulary, as published)."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = TRAIN_LIMIT,
    max_new_tokens: int = RESPONSE_TOKENS,
    epochs: int = typer.Option(6),
    lr: float = typer.Option(6e-4),
    batch_size: int = typer.Option(8),
    max_length: int = MAX_LENGTH,
    held_out: float = HELD_OUT,
    cache_features: bool = CACHE_FEATURES,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    dtype: str = TRAIN_DTYPE,
    device: str = DEVICE,
) -> None:
    """Train a DFlash block drafter (random anchors, block-local attention, exp(-(k-1)/gamma) CE); used by
    `dflash` and `ddtree`."""
    _check_options(locals())
    from methods.dflash import DFlashModel, choose_mask_token, decay_gamma
    from specbench.training.features import token_counts
    from specbench.training.vocab import build_vocab_mapping

    if block_size < 2 or layers < 1 or anchors < 1:
        raise SpecbenchError(f"dflash: need block size >= 2, layers >= 1, anchors >= 1 (got {block_size}, {layers}, "
                             f"{anchors})")
    ids = [int(x) for x in target_layer_ids.split(",") if x.strip()] or None
    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens, device)
    mask = mask_token_id if mask_token_id is not None else choose_mask_token(t.tokenizer, examples)
    vocab_ids, coverage = None, 1.0
    if draft_vocab:
        d2t, _, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), min(draft_vocab, t.vocab_size))
        vocab_ids = torch.arange(d2t.numel()) + d2t
    model = DFlashModel.from_target(t, layers, block_size, mask, ids, vocab_ids)
    gamma = decay_gamma(block_size)
    typer.echo(f"dflash: {layers} layers, block {block_size}, taps {model.config.target_layer_ids}, mask id {mask}, "
               f"gamma {gamma}, draft vocabulary {draft_vocab or t.vocab_size} ({100 * coverage:.2f}% of response tokens)")
    recipe = _recipe(lr, epochs, batch_size, max_length, dtype=dtype, layers=layers, block_size=block_size, anchors=anchors,
                     gamma=gamma, mask_token_id=mask, target_layer_ids=model.config.target_layer_ids,
                     draft_vocab=draft_vocab, vocab_coverage=coverage)
    recipe.warmup_ratio, recipe.grad_clip = 0.04, 1.0  # the reference recipe
    _fit(t, examples, model, lambda b: model.training_loss(b, anchors=anchors, gamma=gamma), list(model.taps),
         lambda folder: model.save(folder, t, recipe.__dict__), out, recipe, held_out, data_file, cache_features)


@train_app.command("pacer")
def pacer(
    out: Path = OUT,
    target: str = TARGET,
    draft: str = typer.Option("", help="SpS draft model (empty = the shipped one for the target)."),
    window: int = typer.Option(50, help="Drafts per replayed step (the paper drafts 50)."),
    position_embedding: bool = typer.Option(True, help="Learned draft-position embedding (off = the paper's ablation)."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = TRAIN_LIMIT,
    max_new_tokens: int = RESPONSE_TOKENS,
    epochs: int = typer.Option(5),
    lr: float = typer.Option(5e-4),
    batch_size: int = typer.Option(4, help="Responses (packed sequences) per step."),
    held_out: float = HELD_OUT,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    device: str = DEVICE,
) -> None:
    """Train PACER's pre-verification layer on replayed speculative decoding (binary CE)."""
    _check_options(locals())
    from methods.pacer import train_preverifier

    if window < 1:
        raise SpecbenchError(f"--window must be >= 1, got {window}")
    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens, device)
    recipe = _recipe(lr, epochs, batch_size, 0, window=window, position_embedding=position_embedding,
                     draft=draft or "shipped")
    recipe.betas = (0.9, 0.999)  # the paper's AdamW betas
    recipe.dtype = "bfloat16"  # autocast: ~2x faster on CPU; the layer and optimizer state stay fp32
    final = train_preverifier(t, examples, data_file, draft, window, position_embedding, recipe, out, held_out)
    from specbench import distributed

    if distributed.current().main:
        typer.echo(f"held-out: {json.dumps(final)}; pre-verification layer in {Path(out) / 'drafter'}")


SPECBLOCK_VARIANTS = {  # the paper's Table 2 base-architecture ablations that need their own training
    "full": {},
    "no-broadcast": {"prefix_broadcast": False},
    "no-shift": {"layer_shift": False},
    "no-valid-prefix": {"valid_prefix": False},
}


@train_app.command("specblock")
def specblock(
    out: Path = OUT,
    target: str = TARGET,
    variant: str = typer.Option("full", help="full, or an ablation: no-broadcast, no-shift, no-valid-prefix."),
    draft_vocab: int = typer.Option(4096, help="Reduced draft vocabulary (most frequent response tokens)."),
    block_size: int = typer.Option(4, help="K: dependent slots per drafter forward."),
    layers: int = typer.Option(2, help="Drafter decoder layers (the target's layer shapes)."),
    rank_hidden: int = typer.Option(256, help="Width of the rank head's MLP."),
    rank_start: Optional[int] = typer.Option(None, help="Steps before the rank loss starts "
                                                        "(paper 2,000 of ~20 epochs; default: 25% of the steps)."),
    cross_block_start: int = typer.Option(0, help="Steps before block-2 training starts (paper 0; reference: "
                                                  "the rank start)."),
    cross_fraction: float = typer.Option(0.25, help="Share of positions that also train a block-2 continuation."),
    decay: float = typer.Option(1.0, help="Slot loss weight decay^k (paper 1.0)."),
    normalise: str = typer.Option("block", help="slot: eq. 6's 1/N_k per slot (needs large batches); block: 1/N_0."),
    prompts: Optional[str] = PROMPTS,
    data_dir: Optional[str] = DATA_DIR,
    limit: Optional[int] = TRAIN_LIMIT,
    max_new_tokens: int = RESPONSE_TOKENS,
    epochs: int = typer.Option(3),
    lr: float = typer.Option(1e-3, help="Paper 5e-5 over 20 epochs of ~500k conversations; scaled up for a CPU budget."),
    batch_size: int = typer.Option(8),
    max_length: int = MAX_LENGTH,
    held_out: float = HELD_OUT,
    cache_features: bool = CACHE_FEATURES,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    dtype: str = typer.Option("bfloat16", help="bfloat16 (autocast) or float32."),
    device: str = DEVICE,
) -> None:
    """Train a SpecBlock drafter: valid-prefix masked block losses, cross-block unrolling, rank head."""
    _check_options(locals())
    from methods.eagle3 import eagle3_taps
    from methods.specblock_checkpoint import save_specblock
    from methods.specblock_model import SpecBlockConfig, SpecBlockModel
    from methods.specblock_train import LossSettings, SpecBlockLoss
    from specbench.training.features import token_counts
    from specbench.training.vocab import build_vocab_mapping

    if variant not in SPECBLOCK_VARIANTS:
        raise SpecbenchError(f"unknown SpecBlock variant {variant!r}; choose from {', '.join(SPECBLOCK_VARIANTS)}")
    overrides = dict(SPECBLOCK_VARIANTS[variant])
    valid = overrides.pop("valid_prefix", True)
    t, data_file, examples = _training_data(target, prompts, data_dir, limit, max_new_tokens, max_prompt_tokens, device)
    d2t, t2d, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), draft_vocab)
    typer.echo(f"draft vocabulary {draft_vocab}: {100 * coverage:.2f}% of response tokens")
    config = SpecBlockConfig.from_target(t, draft_vocab, block_size=block_size, num_layers=layers,
                                         rank_hidden=rank_hidden, **overrides)
    model = SpecBlockModel(config, eagle3_taps(t.num_layers), t.model.get_input_embeddings()).to(t.device)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    n_train = len(examples) - max(1, int(len(examples) * held_out))
    total_steps = epochs * ((n_train + batch_size - 1) // batch_size)
    start = rank_start if rank_start is not None else total_steps // 4
    if normalise not in ("slot", "block"):
        raise SpecbenchError(f"--normalise must be 'slot' or 'block' (got {normalise!r})")
    settings = LossSettings(valid_prefix=valid, rank_start=start, cross_fraction=cross_fraction, decay=decay,
                            normalise=normalise, cross_block_start=cross_block_start)
    recipe = _recipe(lr, epochs, batch_size, max_length, variant=variant, draft_vocab=draft_vocab,
                     vocab_coverage=coverage, block_size=block_size, layers=layers, rank_hidden=rank_hidden,
                     rank_start=start,
                     cross_fraction=cross_fraction, decay=decay, valid_prefix=valid, normalise=normalise,
                     cross_block_start=cross_block_start)
    recipe.dtype = dtype
    recipe.warmup_ratio = 0.015  # paper: 1.5% warmup
    _fit(t, examples, model, SpecBlockLoss(model, settings), list(model.taps),
         lambda folder: save_specblock(folder, model, t, recipe.__dict__), out, recipe, held_out, data_file,
         cache_features)
