"""`specbench train specblock`: a SpecBlock drafter (the objective is in ``objective.py``:
valid-prefix masked block losses, cross-block unrolling, rank head). ``--variant`` trains the
drafter one of the registered variant classes loads (``SpecBlockDrafter.trained_with``: the
paper's Table 2 base-architecture ablations)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import typer

from methods.specblock import drafter
from specbench.errors import SpecbenchError
from specbench.training.plugin import MethodTrainer, TrainOptions, option


def variants() -> dict[str, dict]:
    """variant name -> what it changes, from the drafter classes of methods/specblock/drafter.py (in order)."""
    found: dict[str, dict] = {}
    for cls in vars(drafter).values():
        if isinstance(cls, type) and issubclass(cls, drafter.SpecBlockDrafter):
            found.setdefault(cls.variant(), dict(cls.trained_with))
    return found


_ABLATIONS = ", ".join(v for v in variants() if v != "full")


@dataclass
class SpecBlockTrainOptions(TrainOptions):
    variant: str = option("full", f"full, or an ablation: {_ABLATIONS}.")
    draft_vocab: int = option(4096, "Reduced draft vocabulary (most frequent response tokens).", ge=0)
    block_size: int = option(4, "K: dependent slots per drafter forward.", ge=1)
    layers: int = option(2, "Drafter decoder layers (the target's layer shapes).", ge=1)
    rank_hidden: int = option(256, "Width of the rank head's MLP.", ge=1)
    bonus_row: Literal["once", "duplicate"] = option(
        "once", "Block 1's reading of the last committed pair: once = each pair's own row group (ours, the "
                "paper's); duplicate = a copy one position later that also sees its pair's row group (the "
                "authors' inference code). Recorded in the checkpoint; the drafter runs it by default.")
    rank_start: Optional[int] = option(None, "Steps before the rank loss starts (paper 2,000 of ~20 epochs; default: "
                                             "25% of the steps).", ge=0)
    cross_block_start: int = option(0, "Steps before block-2 training starts (paper 0; reference: the rank start).",
                                    ge=0)
    cross_fraction: float = option(0.25, "Share of positions that also train a block-2 continuation.", ge=0, lt=1)
    decay: float = option(1.0, "Slot loss weight decay^k (paper 1.0).", gt=0)
    normalise: Literal["slot", "block"] = option("block", "slot: eq. 6's 1/N_k per slot (needs large batches); block: 1/N_0.")
    epochs: int = option(3)
    lr: float = option(1e-3, "Paper 5e-5 over 20 epochs of ~500k conversations; scaled up for a CPU budget.")
    batch_size: int = option(8)
    dtype: str = option("bfloat16", "bfloat16 (autocast) or float32.")


class SpecBlockTrainer(MethodTrainer):
    """Train a SpecBlock drafter: valid-prefix masked block losses, cross-block unrolling, rank head."""

    command = "specblock"
    Options = SpecBlockTrainOptions

    def check(self, o: SpecBlockTrainOptions) -> None:
        known = variants()
        if o.variant not in known:
            raise SpecbenchError(f"unknown SpecBlock variant {o.variant!r}; choose from {', '.join(known)}")

    def train(self, o: SpecBlockTrainOptions) -> dict:
        from methods.taps import eagle3_taps
        from methods.specblock.checkpoint import save_specblock
        from methods.specblock.model import SpecBlockConfig, SpecBlockModel
        from methods.specblock.objective import LossSettings, SpecBlockLoss
        from specbench.training.features import token_counts
        from specbench.training.fit import fit_features, recipe_for, training_data
        from specbench.training.vocab import build_vocab_mapping

        overrides = variants()[o.variant]
        valid = overrides.pop("valid_prefix", True)
        t, data_file, examples = training_data(o)
        d2t, t2d, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), o.draft_vocab)
        typer.echo(f"draft vocabulary {o.draft_vocab}: {100 * coverage:.2f}% of response tokens")
        config = SpecBlockConfig.from_target(t, o.draft_vocab, block_size=o.block_size, num_layers=o.layers,
                                             rank_hidden=o.rank_hidden, bonus_row=o.bonus_row, **overrides)
        model = SpecBlockModel(config, eagle3_taps(t.num_layers), t.model.get_input_embeddings()).to(t.device)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        n_train = len(examples) - max(1, int(len(examples) * o.held_out))
        total_steps = o.max_steps or o.epochs * ((n_train + o.batch_size - 1) // o.batch_size)
        start = o.rank_start if o.rank_start is not None else total_steps // 4
        settings = LossSettings(valid_prefix=valid, rank_start=start, cross_fraction=o.cross_fraction, decay=o.decay,
                                normalise=o.normalise, cross_block_start=o.cross_block_start)
        recipe = recipe_for(o, variant=o.variant, draft_vocab=o.draft_vocab, vocab_coverage=coverage,
                            block_size=o.block_size, layers=o.layers, rank_hidden=o.rank_hidden,
                            bonus_row=o.bonus_row, rank_start=start,
                            cross_fraction=o.cross_fraction, decay=o.decay, valid_prefix=valid,
                            normalise=o.normalise, cross_block_start=o.cross_block_start,
                            shift_init="identity" if config.layer_shift else "none")  # drafters before it: random
        recipe.warmup_ratio = 0.015  # paper: 1.5% warmup
        return fit_features(t, examples, model, SpecBlockLoss(model, settings), list(model.taps),
                            lambda folder: save_specblock(folder, model, t, recipe.__dict__), recipe, o, data_file)
