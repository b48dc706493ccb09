"""`specbench train medusa`: Medusa-1 heads on the frozen target (sum_k 0.8^k CE of head k against
the token k+2 ahead)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.training.plugin import MethodTrainer, TrainOptions, option


@dataclass
class MedusaTrainOptions(TrainOptions):
    heads: int = option(5, "Medusa heads (head k predicts k+2 tokens ahead).", ge=1)
    layers: int = option(1, "ResBlocks per head.", ge=1)
    shared_lm_head: bool = option(True, "Reuse the target's frozen lm_head in every head (small checkpoint).")
    epochs: int = option(2)
    lr: float = option(1e-3)
    batch_size: int = option(8)


class MedusaTrainer(MethodTrainer):
    """Train Medusa-1 heads on the frozen target (sum_k 0.8^k CE of head k vs token k+2 ahead)."""

    command = "medusa"
    Options = MedusaTrainOptions

    def train(self, o: MedusaTrainOptions) -> dict:
        from methods.medusa.drafter import MedusaHeads, save_medusa
        from specbench.training.fit import fit_features, recipe_for, training_data

        t, data_file, examples = training_data(o)
        model = MedusaHeads.for_target(t, num_heads=o.heads, num_layers=o.layers, shared_lm_head=o.shared_lm_head)
        recipe = recipe_for(o, heads=o.heads, layers=o.layers, shared_lm_head=o.shared_lm_head)
        recipe.warmup_ratio = 0.1
        return fit_features(t, examples, model, model.training_loss, [-1],
                            lambda folder: save_medusa(folder, model, t, recipe.__dict__, dtype=torch.bfloat16),
                            recipe, o, data_file)
