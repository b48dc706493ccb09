"""A KV cache for a batch of requests of different lengths: one dense row per request, ragged inside.

Layout (right padding): request b's committed keys/values sit at columns [0, lengths[b]) of its row;
columns [lengths[b], width) are dead (a shorter prompt, or rows that request dropped) and every
forward masks them. A step appends its new rows for every request after the widest one, at
[width, width + Q), and ``commit`` moves each request's kept rows down to its own length, so a
request never pays for another's rejected rows, only for the gap up to the longest. Rows are
removed when a request leaves and appended when one joins (its own cache from a batch-1 prefill).

Keys are cached after RoPE with each request's own position ids, so moving a key to another column
changes nothing it computes: the column is storage, the position is baked in.

``RaggedCache`` holds the target's (or an HF draft model's) ``DynamicCache``; ``commit_rows`` and
``widen`` are the same surgery on plain [B, heads, S, d] tensors, for drafters with their own caches.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from specbench.engine import kvcache


def _layers(cache) -> Iterator[tuple[object, str, str | int]]:
    """(holder, key attribute or index) of every key and value tensor, on both DynamicCache layouts."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            yield layer, "keys"
            yield layer, "values"
    else:  # transformers < 4.54
        for i in range(len(cache.key_cache)):
            yield cache.key_cache, i
            yield cache.value_cache, i


def _get(holder, key) -> torch.Tensor:
    return holder[key] if isinstance(key, int) else getattr(holder, key)


def _set(holder, key, value: torch.Tensor) -> None:
    if isinstance(key, int):
        holder[key] = value
    else:
        setattr(holder, key, value)


def widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [B, heads, S, d] with zero columns appended up to ``width`` (dead columns must be finite:
    a masked key still enters q.k before the mask is added)."""
    if t.shape[2] >= width:
        return t
    pad = torch.zeros(*t.shape[:2], width - t.shape[2], t.shape[3], dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], 2)


def commit_rows(t: torch.Tensor, lengths: Sequence[int], start: int, kept: Sequence[Sequence[int]]) -> torch.Tensor:
    """For every request b, the rows ``start + kept[b]`` of ``t`` [B, heads, S, d] moved to columns
    lengths[b].. of its row, in order; returns ``t`` cut to the longest new length (in place where it can)."""
    new_width = max(length + len(rows) for length, rows in zip(lengths, kept))
    most = max(len(rows) for rows in kept)
    if most == 0 or all(length == start and list(rows) == list(range(len(rows)))
                        for length, rows in zip(lengths, kept)):
        return t[:, :, :new_width]  # every kept row is already in place
    # Requests that keep fewer rows than the most pad with row 0 written past their new length, into
    # columns that are dead for them (and below width: lengths[b] <= start and most <= the block size).
    src = torch.tensor([[start + r for r in rows] + [start] * (most - len(rows)) for rows in kept])
    dst = torch.tensor([[length + i for i in range(most)] for length in lengths])
    shape = (t.shape[0], t.shape[1], most, t.shape[3])
    src = src.to(t.device)[:, None, :, None].expand(shape)
    dst = dst.to(t.device)[:, None, :, None].expand(shape)
    t.scatter_(2, dst, t.gather(2, src))  # gather copies first, so sources and destinations may overlap
    return t[:, :, :new_width]


class RaggedCache:
    """An HF cache whose batch rows are requests with their own lengths (see the module docstring).

    ``lengths[b]``: committed positions of row b; ``width``: the physical length, max(lengths) between
    steps. The cache object itself is what a model forward takes (``cache``)."""

    def __init__(self) -> None:
        self.cache = None
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.cache is None else kvcache.seq_length(self.cache)

    def live(self, device: torch.device) -> torch.Tensor:
        """[B, width] bool: the committed columns of every row (what every new row may attend to)."""
        lengths = torch.tensor(self.lengths, device=device)
        return torch.arange(self.width, device=device)[None] < lengths[:, None]

    @torch.inference_mode()  # caches filled under inference_mode may only be edited inside it
    def add(self, single, length: int) -> None:
        """Append a request whose cache ``single`` (batch 1) holds its ``length`` committed positions."""
        if self.cache is None or not self.lengths:
            self.cache = single
            for holder, key in _layers(single):
                _set(holder, key, _get(holder, key)[:, :, :length])
            self.lengths = [length]
            return
        width = max(self.width, length)
        for (holder, key), (one, one_key) in zip(_layers(self.cache), _layers(single)):
            rows = widen(_get(holder, key), width)
            _set(holder, key, torch.cat([rows, widen(_get(one, one_key)[:, :, :length], width)], 0))
        self.lengths.append(length)

    @torch.inference_mode()
    def remove(self, rows: Sequence[int]) -> None:
        """Drop the rows of requests that left; the rest keep their order."""
        gone = set(rows)
        keep = [b for b in range(len(self.lengths)) if b not in gone]
        if len(keep) == len(self.lengths):
            return
        self.lengths = [self.lengths[b] for b in keep]
        width = max(self.lengths, default=0)
        index = None
        for holder, key in _layers(self.cache):
            t = _get(holder, key)
            if index is None:
                index = torch.tensor(keep, dtype=torch.long, device=t.device)
            _set(holder, key, t.index_select(0, index.to(t.device))[:, :, :width])

    @torch.inference_mode()
    def commit(self, start: int, kept: Sequence[Sequence[int]]) -> None:
        """After a forward that appended a block at column ``start``: keep, per request, the block rows
        ``kept[b]`` (offsets from ``start``) at lengths[b].. and drop every other appended row."""
        for holder, key in _layers(self.cache):
            _set(holder, key, commit_rows(_get(holder, key), self.lengths, start, kept))
        self.lengths = [length + len(rows) for length, rows in zip(self.lengths, kept)]

    def truncate(self, b: int, length: int) -> None:
        """Forget row b's positions from ``length`` on (its columns become dead; nothing moves)."""
        if length > self.lengths[b]:
            raise ValueError(f"row {b} holds {self.lengths[b]} positions, cannot keep {length}")
        self.lengths[b] = length


class RaggedKV:
    """One attention layer's keys and values [B, heads, width, d] with a length per request: the same
    layout for a drafter that keeps its own cache as plain tensors (``model(..., past=(keys, values))``)."""

    def __init__(self, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.keys = torch.zeros(0, heads, 0, head_dim, device=device, dtype=dtype)
        self.values = self.keys
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.keys.shape[2]

    @property
    def past(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def live(self) -> torch.Tensor:
        """[B, width] bool: every row's committed columns."""
        lengths = torch.tensor(self.lengths, device=self.keys.device)
        return torch.arange(self.width, device=self.keys.device)[None] < lengths[:, None]

    def add_empty(self, count: int) -> None:
        """Append ``count`` requests with nothing cached yet."""
        zeros = torch.zeros(count, *self.keys.shape[1:], dtype=self.keys.dtype, device=self.keys.device)
        self.keys = torch.cat([self.keys, zeros], 0)
        self.values = torch.cat([self.values, zeros], 0)
        self.lengths += [0] * count

    def remove(self, rows: Sequence[int]) -> None:
        gone = set(rows)
        keep = [b for b in range(len(self.lengths)) if b not in gone]
        index = torch.tensor(keep, dtype=torch.long, device=self.keys.device)
        self.lengths = [self.lengths[b] for b in keep]
        width = max(self.lengths, default=0)
        self.keys = self.keys.index_select(0, index)[:, :, :width]
        self.values = self.values.index_select(0, index)[:, :, :width]

    @torch.inference_mode()
    def keep(self, extended: tuple[torch.Tensor, torch.Tensor], kept: Sequence[Sequence[int]]) -> None:
        """``extended`` = these keys/values with a block of new rows appended at ``width`` (what a forward
        over past=self.past returns): keep, per request, block rows ``kept[b]`` at its length."""
        start = self.width
        self.keys = commit_rows(extended[0], self.lengths, start, kept)
        self.values = commit_rows(extended[1], self.lengths, start, kept)
        self.lengths = [length + len(rows) for length, rows in zip(self.lengths, kept)]
