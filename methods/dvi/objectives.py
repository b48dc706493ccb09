"""DVI's loss weights over improve steps and its losses: pure functions of logits, drafts and rewards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from methods.dvi.options import DVIOptions


@dataclass(frozen=True)
class Weights:
    kl: float
    rl: float  # reward-masked CE on the buffer, and the on-policy term's weight
    ce: float
    beta: float  # KL weight inside the on-policy term


def schedule(step: int, o: DVIOptions) -> Weights:
    """Loss weights at improve step ``step`` (0-based) for ``o.objective``."""
    if o.objective == "kl":
        return Weights(1.0, 0.0, 0.0, 0.0)
    if o.objective == "ce":
        return Weights(0.0, 1.0, 0.0, 0.0)
    if o.objective == "pg":
        return Weights(0.0, 1.0, 0.0, 0.0)
    t = 0.0 if step < o.warmup else min(1.0, (step - o.warmup + 1) / max(o.ramp, 1))
    return Weights(kl=(1 - t) + t * o.kl_min, rl=t, ce=o.ce_weight, beta=o.beta_start + t * (o.beta_end - o.beta_start))


def kl_to(verifier_logits: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(z_V) || q)."""
    log_p = F.log_softmax(verifier_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def reward_masked_ce(log_q: torch.Tensor, drafts: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """-sum_j r_j log q(y_j) / sum_j r_j: credit only where the verifier accepted."""
    picked = log_q.gather(1, drafts[:, None])[:, 0]
    return -(rewards * picked).sum() / rewards.sum().clamp_min(1.0)


def reinforce(log_q: torch.Tensor, drafts: torch.Tensor, rewards: torch.Tensor, baseline: float) -> torch.Tensor:
    """On-policy REINFORCE with a constant baseline: -mean (r - b) log q(y)."""
    picked = log_q.gather(1, drafts[:, None])[:, 0]
    return -((rewards - baseline) * picked).mean()
