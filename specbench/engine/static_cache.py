"""A preallocated KV cache for the compiled engine (``--engine compiled``).

Every layer's keys and values live in tensors of one fixed shape, [1, kv_heads, capacity + spare, head_dim],
allocated once, so a compiled forward finds the same buffers (the same addresses, which CUDA graphs need)
at every step. A forward writes its rows where ``slots`` says, one index copy per tensor: the real rows at
the positions after the committed prefix, a bucket's padding rows into the ``spare`` columns past
``capacity``, which no real row ever sees. Committing a tree's accepted rows is one gather and one copy per
tensor; a chain accepted from its start (vanilla, most chain steps) moves nothing. Columns past the committed
prefix hold stale rows: the attention mask never shows them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


def kv_shape(config) -> tuple[int, int]:
    """(key/value heads, head dim) of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


class StaticKV(Cache):
    """Fixed keys/values per layer; ``slots`` ([rows] long, on the device) says where the next forward's rows
    go. ``rows`` counts the columns [0, rows) that hold this request's rows in order (the committed prefix
    and whatever a forward appended after it)."""

    def __init__(self, config, capacity: int, spare: int, dtype: torch.dtype, device: torch.device) -> None:
        # No Cache.__init__: its constructor differs between transformers releases, and this class answers
        # every call a decoder makes of its cache (update; get_seq_length where positions are not given).
        self.layers: list = []
        self.offloading = False
        kv_heads, head_dim = kv_shape(config)
        shape = (1, kv_heads, capacity + spare, head_dim)
        n = config.num_hidden_layers
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        if device.type == "cuda":  # CUDA graphs keep these addresses; the graphs write them in place
            for t in self.keys + self.values:
                torch._dynamo.mark_static_address(t)
        self.capacity, self.spare, self.rows = capacity, spare, 0
        self.slots = torch.zeros(1, dtype=torch.long, device=device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states.to(keys.dtype))
        values.index_copy_(2, self.slots, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.rows

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    def __len__(self) -> int:
        return len(self.keys)

    @torch.no_grad()
    def keep(self, start: int, rows: list[int]) -> None:
        """Keep the rows at ``start + rows[i]`` at ``start + i`` (``rows`` ascending from 0); ``rows`` then
        counts ``start + len(rows)``."""
        n = len(rows)
        if rows != list(range(n)):
            source = torch.tensor(rows, dtype=torch.long, device=self.slots.device) + start
            for t in self.keys + self.values:
                t[:, :, start:start + n] = t.index_select(2, source)  # the gather copies first: no aliasing
        self.rows = start + n
