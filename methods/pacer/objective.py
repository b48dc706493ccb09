"""PACER's training objective: binary cross-entropy of the acceptance logits on draft rows, with accuracy and
AUC."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from methods.pacer.model import PreVerifier
from methods.pacer.packing import PacerBatch


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    greater = (pos.unsqueeze(1) > neg.unsqueeze(0)).float().mean()
    ties = (pos.unsqueeze(1) == neg.unsqueeze(0)).float().mean()
    return float(greater + 0.5 * ties)


def acceptance_logits(model: PreVerifier, batch: PacerBatch) -> torch.Tensor:
    """The layer's acceptance logit at every row of a packed batch [B, T] (Fig. 5 visibility)."""
    mask = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device).masked_fill_(
        ~batch.mask, torch.finfo(torch.float32).min)
    return model(batch.hidden, batch.draft_pos, batch.position_ids, attention_mask=mask)


def pacer_loss(model: PreVerifier, batch: PacerBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Binary cross-entropy of the acceptance logits on draft rows."""
    logits = acceptance_logits(model, batch)
    keep = batch.labels >= 0
    z, y = logits[keep].float(), batch.labels[keep]
    loss = F.binary_cross_entropy_with_logits(z, y)
    with torch.no_grad():
        first = keep & (batch.draft_pos == 1)
        metrics = {"bce": float(loss), "accuracy": float(((z > 0).float() == y).float().mean()),
                   "positive_rate": float(y.mean()), "mean_prob": float(torch.sigmoid(z).mean()),
                   "auc": binary_auc(z, y), "auc_draft1": binary_auc(logits[first].float(), batch.labels[first])}
    return loss, metrics
