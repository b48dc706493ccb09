"""DVI's options (docs/methods.md#dvi), and the paper's single-objective ablations' (Table 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specbench.options import option

Objective = Literal["kl-rl", "kl", "pg", "ce"]


@dataclass
class DVIOptions:
    # Paper: 2 of 32. SmolLM2: acceptance is flat over 2..8, cost is not.
    layer: int = option(2, "Layers [0, layer) draft; the rest verify.", ge=1)
    k: int = option(4, "Drafts per verify call.", ge=1, tokens=True)
    learn: bool = option(True, "false = frozen head (a no-learning baseline).")
    objective: Objective = option("kl-rl", "kl-rl: KL then RL (DVI); kl, pg, ce: the paper's single-objective "
                                           "ablations (distillation, REINFORCE, reward-masked CE).")
    lr: float = option(5e-4, "AdamW learning rate of the LoRA head.", ge=0)
    weight_decay: float = option(0.01, "AdamW weight decay.", ge=0)
    rank: int = option(8, "LoRA rank.", ge=1)
    alpha: float = option(16.0, "LoRA alpha (scale alpha / rank).", ge=0)
    dropout: float = option(0.05, "LoRA dropout.", ge=0, lt=1)
    buffer: int = option(2048, "Replay buffer capacity (tuples).", ge=1)
    batch: int = option(32, "Minibatch per improve step.", ge=1)
    update_every: int = option(1, "Verify calls per improve step (1 = one step per rollout).", ge=1)
    warmup: int = option(40, "KL-only steps.", ge=0)
    ramp: int = option(80, "Steps from KL to RL.", ge=0)
    kl_min: float = option(0.05, "KL weight after the ramp.", ge=0)
    ce_weight: float = option(0.1, "Cross-entropy weight.", ge=0)
    beta_start: float = option(0.5, "KL weight inside the on-policy term, at the start of the ramp.", ge=0)
    beta_end: float = option(0.05, "KL weight inside the on-policy term, after the ramp.", ge=0)
    baseline_ema: float = option(0.9, "Decay of the reward baseline's moving average.", ge=0, le=1)
    clip: float = option(1.0, "Gradient-norm clip.", ge=0)
    head: str = option("", "Folder with a saved head (warm start); empty = fresh LoRA (B = 0: the plain early exit).")
    seed: int = option(0, "Seed of the LoRA init, its dropout and the replay sampling.", ge=0)



@dataclass
class DVIKLOptions(DVIOptions):
    objective: Objective = "kl"


@dataclass
class DVIPGOptions(DVIOptions):
    objective: Objective = "pg"


@dataclass
class DVICEOptions(DVIOptions):
    objective: Objective = "ce"
