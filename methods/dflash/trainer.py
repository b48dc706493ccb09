"""`specbench train dflash`: a DFlash block drafter (random anchors, block-local attention,
exp(-(k-1)/gamma)-weighted CE), used by `dflash` and `ddtree`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import typer

from specbench.training.checks import layer_numbers
from specbench.training.plugin import MethodTrainer, TrainOptions, option


@dataclass
class DFlashTrainOptions(TrainOptions):
    layers: int = option(3, "Drafter decoder layers.", ge=1)
    block_size: int = option(16, "Block L = bonus + L-1 drafted slots (the tree's maximum depth is L-1).", ge=2)
    target_layer_ids: str = option("", "Target layers tapped, comma-separated (default: evenly spaced, one per "
                                       "drafter layer).")
    mask_token_id: Optional[int] = option(None, "MASK id (default: the tokenizer's, else an unused added token).", ge=0)
    anchors: int = option(64, "Random block anchors per sequence and step (reference: up to 512).", ge=1)
    draft_vocab: int = option(4096, "Score only the target lm_head's rows of the N most frequent response tokens "
                                    "(0 = the whole vocabulary, as published).", ge=0)
    epochs: int = option(6)
    lr: float = option(6e-4)
    batch_size: int = option(8)


class DFlashTrainer(MethodTrainer):
    """Train a DFlash block drafter (random anchors, block-local attention, exp(-(k-1)/gamma) CE); used by
    `dflash` and `ddtree`."""

    command = "dflash"
    Options = DFlashTrainOptions

    def check(self, o: DFlashTrainOptions) -> None:
        layer_numbers(o.target_layer_ids, "--target-layer-ids")  # block size, layers and anchors: their ranges

    def train(self, o: DFlashTrainOptions) -> dict:
        from methods.dflash.drafter import DFlashModel, choose_mask_token, decay_gamma
        from specbench.training.features import token_counts
        from specbench.training.fit import fit_features, recipe_for, training_data
        from specbench.training.vocab import build_vocab_mapping

        ids = layer_numbers(o.target_layer_ids, "--target-layer-ids") or None
        t, data_file, examples = training_data(o)
        mask = o.mask_token_id if o.mask_token_id is not None else choose_mask_token(t.tokenizer, examples)
        vocab_ids, coverage = None, 1.0
        if o.draft_vocab:
            d2t, _, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), min(o.draft_vocab, t.vocab_size))
            vocab_ids = torch.arange(d2t.numel()) + d2t
        model = DFlashModel.from_target(t, o.layers, o.block_size, mask, ids, vocab_ids)
        gamma = decay_gamma(o.block_size)
        typer.echo(f"dflash: {o.layers} layers, block {o.block_size}, taps {model.config.target_layer_ids}, mask id "
                   f"{mask}, gamma {gamma}, draft vocabulary {o.draft_vocab or t.vocab_size} ({100 * coverage:.2f}% of "
                   "response tokens)")
        recipe = recipe_for(o, layers=o.layers, block_size=o.block_size, anchors=o.anchors, gamma=gamma,
                            mask_token_id=mask, target_layer_ids=model.config.target_layer_ids,
                            draft_vocab=o.draft_vocab, vocab_coverage=coverage)
        recipe.warmup_ratio, recipe.grad_clip = 0.04, 1.0  # the reference recipe
        return fit_features(t, examples, model, lambda b: model.training_loss(b, anchors=o.anchors, gamma=gamma),
                            list(model.taps), lambda folder: model.save(folder, t, recipe.__dict__), recipe, o,
                            data_file)
