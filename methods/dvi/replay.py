"""DVI's replay buffer of logged draft positions."""

from __future__ import annotations

import torch


class ReplayBuffer:
    """Ring buffer of logged draft positions. Storage grows geometrically up to ``capacity`` (a
    full SmolLM2 buffer holds two vocabulary-wide rows per tuple, ~400 MB in bf16)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.size, self.next = capacity, 0, 0
        self.data: dict[str, torch.Tensor] = {}

    def _reserve(self, rows: dict[str, torch.Tensor], needed: int) -> None:
        have = next(iter(self.data.values())).shape[0] if self.data else 0
        if needed <= have or have == self.capacity:
            return
        size = min(self.capacity, max(needed, 2 * have, 64))
        grown = {k: torch.empty((size, *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in rows.items()}
        for k, v in self.data.items():
            grown[k][:have] = v
        self.data = grown

    def push(self, rows: dict[str, torch.Tensor]) -> None:
        n = rows["x"].shape[0]
        self._reserve(rows, self.next + n)
        idx = (torch.arange(n) + self.next) % self.capacity
        for k, v in rows.items():
            self.data[k][idx.to(v.device)] = v
        self.next = (self.next + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, self.size, (min(n, self.size),), generator=generator)
        return {k: v[idx.to(v.device)] for k, v in self.data.items()}

    def __len__(self) -> int:
        return self.size


def cat_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
