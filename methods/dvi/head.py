"""DVI's draft head: a LoRA on the target's frozen lm_head, read off an early layer's state."""

from __future__ import annotations

import math

import torch
from torch import nn

HEAD_FILE = "dvi_head.safetensors"


class DraftHead(nn.Module):
    """z_D = s * (W_0 x + (alpha/r) B A drop(x)), x = N_D(h). W_0 and N_D are the target's frozen
    lm_head and final norm (shared, not copied: frozen, so identical and half the memory); only
    A, B and s train, in fp32. B starts at zero, so the fresh head is the plain early exit."""

    def __init__(self, lm_head: nn.Module, norm: nn.Module, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.frozen = [lm_head, norm]  # a list keeps them out of this module's parameters
        hidden, vocab = lm_head.weight.shape[1], lm_head.weight.shape[0]
        self.lora_A = nn.Parameter(torch.empty(rank, hidden))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_B = nn.Parameter(torch.zeros(vocab, rank))
        self.scale = nn.Parameter(torch.ones(()))
        self.factor, self.dropout, self.gen = alpha / rank, dropout, generator

    @torch.no_grad()
    def features(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x = N_D(h) in fp32, base logits W_0 x in the target dtype) for [n, H] states."""
        lm_head, norm = self.frozen
        x = norm(h)
        return x.float(), lm_head(x)

    def logits(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits from cached features; LoRA dropout only in training mode."""
        if self.training and self.dropout > 0:
            keep = (torch.rand(x.shape, generator=self.gen) >= self.dropout).to(x.device)
            x = x * keep / (1 - self.dropout)
        delta = (x @ self.lora_A.T) @ self.lora_B.T
        return self.scale * (base.float() + self.factor * delta)

    def trainable(self) -> dict[str, torch.Tensor]:
        return {"lora_A": self.lora_A, "lora_B": self.lora_B, "scale": self.scale}
