"""The compiled engine's forward: the target at a fixed set of row counts over a preallocated cache.

``--engine compiled`` runs every target forward (prefill chunks, verifies) through ``CompiledForward.run``:
the rows are padded to the next bucket of ``BUCKETS``, so at most one graph per bucket is ever built
(``torch.compile``, shapes static; on CUDA ``mode="reduce-overhead"``, i.e. CUDA graphs), and every input
is a fixed-shape tensor: token ids, positions, and an additive mask over the whole static cache (row r sees
the committed prefix and its own tree ancestors; a padding row sees only its own spare column, so it stays
finite and out of every real row's sight). Keys and values go into ``static_cache.StaticKV``.

The first time a bucket appears (or after the cache grows) its graph is built on dummy inputs that write
only spare columns, inside ``PhaseTimer.paused("graph_compile")``: build time is reported on its own and
never counted in a phase. Built graphs persist in the compiler's on-disk cache (under ``cache_dir()``), so
a second run spends far less there. A recompile beyond the limit raises rather than falling back to eager.
"""

from __future__ import annotations

import os

import torch

from specbench.engine import kvcache
from specbench.engine.packaged import cache_dir
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.errors import SpecbenchError

ENGINES = ("eager", "compiled")  # --engine choices
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows per forward; prefill runs in chunks of the largest
CAPACITY_STEP = 256  # the static cache grows in multiples of this
GRAPH_LIMIT = 512  # graphs per compiled function, every target of a process; past it an error, not eager


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise SpecbenchError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")


def bucket(rows: int) -> int:
    for size in BUCKETS:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows exceed the largest bucket ({BUCKETS[-1]}); split them")


def _configure_compiler() -> None:
    """Graphs in the package's cache folder (a second run reuses them) and no silent eager fallback."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), GRAPH_LIMIT))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def _forward(model, cache, keyword: str, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, hidden: bool):
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                output_hidden_states=hidden, **{keyword: cache})
    return out.logits, (tuple(out.hidden_states) if hidden else None)


_COMPILED: dict[str | None, object] = {}  # mode -> the compiled _forward, one per process (graphs keyed by guards)


def _compiled(mode: str | None):
    """The compiled forward of ``mode``. A module-level function, not a bound method: a deep copy of a drafter
    that holds a ``CompiledForward`` (forced.private_copy) then runs on its own model and cache."""
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(_forward, dynamic=False, mode=mode)
    return _COMPILED[mode]


class CompiledForward:
    """``model``'s forward at the row counts of ``BUCKETS`` over a ``StaticKV`` of at least ``capacity``
    columns (grown on demand, up to ``max_context``)."""

    def __init__(self, model, capacity: int, max_context: int) -> None:
        _configure_compiler()
        self.model = model
        weight = model.get_input_embeddings().weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cuda_graphs = self.device.type == "cuda"
        self.keyword = kvcache.cache_keyword(type(model).forward)
        self.max_context = max_context
        self.floor = torch.finfo(self.dtype).min
        self.cache = None  # static_cache.StaticKV
        self._allocate(self._round(capacity))
        self.mode = "reduce-overhead" if self.cuda_graphs else None

    def _round(self, tokens: int) -> int:
        rounded = -(-max(tokens, 1) // CAPACITY_STEP) * CAPACITY_STEP
        return min(rounded, max(self.max_context, tokens))

    def _allocate(self, capacity: int) -> None:
        from specbench.engine.static_cache import StaticKV  # transformers: imported when a compiled target exists

        old = self.cache
        self.cache = StaticKV(self.model.config, capacity, BUCKETS[-1], self.dtype, self.device)
        if old is not None and old.rows:  # growing mid-request: the rows so far move over
            for new, kept in zip(self.cache.keys + self.cache.values, old.keys + old.values):
                new[:, :, :old.rows] = kept[:, :, :old.rows]
            self.cache.rows = old.rows
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.built: set[tuple[int, bool]] = set()  # (bucket, taps): graphs built for this cache

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` columns (prompt, new tokens and the widest verify after them)."""
        if tokens > self.cache.capacity:
            self._allocate(self._round(tokens))

    @property
    def width(self) -> int:
        return self.cache.capacity + self.cache.spare

    def _buffers(self, size: int) -> tuple[torch.Tensor, ...]:
        """(ids [1, b], positions [1, b], mask [1, 1, b, width], slots [b]) of bucket ``size``, reused."""
        if size not in self._inputs:
            d = self.device
            self._inputs[size] = (torch.zeros(1, size, dtype=torch.long, device=d),
                                  torch.zeros(1, size, dtype=torch.long, device=d),
                                  torch.empty(1, 1, size, self.width, dtype=self.dtype, device=d),
                                  torch.zeros(size, dtype=torch.long, device=d))
        return self._inputs[size]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, hidden: bool):
        return _compiled(self.mode)(self.model, self.cache, self.keyword, ids, positions, mask, hidden)

    def _pad_rows(self, mask: torch.Tensor, slots: torch.Tensor, first: int, size: int) -> None:
        """Rows [first, size) are padding: each writes and sees only its own spare column."""
        if first < size:
            rows = torch.arange(first, size, device=self.device)
            slots[first:] = self.cache.capacity + rows
            mask[0, 0, rows, self.cache.capacity + rows] = 0

    def _build(self, size: int, hidden: bool, timer: PhaseTimer) -> None:
        """Build bucket ``size``'s graph on dummy rows that touch only spare columns (outside the clock)."""
        ids, positions, mask, slots = (torch.zeros_like(t) for t in self._buffers(size))
        mask.fill_(self.floor)
        self._pad_rows(mask, slots, 0, size)
        with timer.paused("graph_compile"):
            self.cache.slots = slots
            for _ in range(3 if self.cuda_graphs else 1):  # CUDA graph trees record on a later call
                self._step(ids, positions, mask, hidden)
        self.built.add((size, hidden))

    def causal_rows(self, start: int, q: int) -> torch.Tensor:
        """For a forward run outside the graphs (layer by layer: ``split_verify``): point the cache's writes at
        columns start..start+q-1 and return the additive mask [1, 1, q, width] that lets row i see columns
        [0, start + i]."""
        if start + q > self.cache.capacity:
            self.reserve(start + q)
        self.cache.slots = torch.arange(start, start + q, device=self.device)
        mask = torch.full((q, self.width), self.floor, dtype=self.dtype, device=self.device)
        mask[:, :start + q].masked_fill_(torch.ones(q, start + q, dtype=torch.bool, device=self.device)
                                         .tril_(diagonal=start), 0)
        return mask[None, None]

    @torch.no_grad()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, start: int,
            hidden: bool, timer: PhaseTimer = NULL_TIMER) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One forward of ``q`` rows (``ids``, ``positions``: [q] on the device) written at columns
        start..start+q-1; row i sees columns [0, start) and the new rows j with ``visible[i, j]`` (None:
        causal). Returns logits [q, V] and, with ``hidden``, every hidden state [q, H] (HF order)."""
        q = ids.shape[0]
        if start + q > self.cache.capacity:
            self.reserve(start + q)
        size = bucket(q)
        if (size, hidden) not in self.built:
            self._build(size, hidden, timer)
        x, pos, mask, slots = self._buffers(size)
        x[0, :q] = ids
        x[0, q:] = 0
        pos[0, :q] = positions
        pos[0, q:] = 0
        mask.fill_(self.floor)
        mask[0, 0, :q, :start] = 0
        block = torch.ones(q, q, dtype=torch.bool, device=self.device).tril_() if visible is None else visible
        mask[0, 0, :q, start:start + q].masked_fill_(block, 0)
        slots[:q] = torch.arange(start, start + q, device=self.device)
        self._pad_rows(mask, slots, q, size)
        self.cache.slots = slots
        logits, states = self._step(x, pos, mask, hidden)
        self.cache.rows = start + q
        logits = logits[0, :q]
        states = tuple(h[0, :q] for h in states) if states is not None else None
        if self.cuda_graphs:  # a graph's outputs are overwritten by its next replay
            logits = logits.clone()
            states = tuple(h.clone() for h in states) if states is not None else None
        return logits, states
