"""What every drafter's training loss receives: token ids, the assistant-token mask, and the
frozen target's hidden-state taps for the same positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """Right-padded batch of target-regenerated conversations.

    input_ids:      [B, T] prompt + response token ids (padding = 0, see attention_mask)
    attention_mask: [B, T] 1 for real tokens
    loss_mask:      [B, T] 1 where the token is part of the target's response (assistant tokens)
    taps:           hidden_states index -> [B, T, H] (fp32); index -1 is the final-norm output
                    that the target's lm_head reads. Always present: -1.
    lm_head:        the target's frozen output layer (H -> V), for soft targets p* = softmax(lm_head(h))
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    taps: dict[int, torch.Tensor]
    lm_head: torch.nn.Module
    meta: dict = field(default_factory=dict)

    def target_logits(self, positions: slice | None = None) -> torch.Tensor:
        """Target logits [B, T', V] from the final-norm tap (computed on demand: V is large)."""
        h = self.taps[-1] if positions is None else self.taps[-1][:, positions]
        return self._logits(h).float()

    def draft_vocab_targets(self, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_vocab [B, T]: the target's argmax lies in the draft vocabulary, the target logits over
        the draft vocabulary [B, T, V_d] fp32) for a bool mask ``t2d`` over the target vocabulary.
        One row at a time, so the full-vocabulary logits (V = 49k) never exist for the whole batch."""
        in_vocab, restricted = [], []
        for row in range(self.taps[-1].shape[0]):
            full = self._logits(self.taps[-1][row])
            in_vocab.append(t2d[full.argmax(-1)])
            restricted.append(full[..., t2d].float())
        return torch.stack(in_vocab), torch.stack(restricted)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The frozen lm_head on final-norm states, in its compute dtype (bf16 under autocast)."""
        with torch.no_grad():
            return self.lm_head(h.to(self.lm_head.weight.dtype))

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                          {k: v.to(device) for k, v in self.taps.items()}, self.lm_head, dict(self.meta))
