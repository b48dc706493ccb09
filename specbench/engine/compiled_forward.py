"""The compiled engine's forward: the target through a few fixed graphs over a preallocated cache.

``--engine compiled`` runs every target forward (prefill chunks, verifies) through ``CompiledForward.run``,
whose inputs are token ids, positions, and an additive mask over the whole static cache (row r sees the
committed prefix and its own tree ancestors among the new rows); keys and values go into
``static_cache.StaticKV``. How many graphs: on CUDA the rows are padded to the next bucket of ``BUCKETS`` (a
padding row sees only its own spare column past the capacity, so it stays finite and out of every real row's
sight), one CUDA graph per bucket (``mode="reduce-overhead"``); on a CPU, where a padded row costs real time,
nothing is padded: one graph for one row, one with a symbolic row count for 2 to ``BUCKETS[-1]`` rows.

A graph is built the first time it is needed (or after the cache grows), on dummy inputs that write only
spare columns, inside ``PhaseTimer.paused("graph_compile")``: build time is reported on its own and never
counted in a phase. The compiler's on-disk cache (under ``cache_dir()``) keeps compiled kernels and autotuning
results for the next run (frozen CPU graphs themselves are rebuilt by every process). A recompile beyond the
limit raises rather than falling back to eager.
"""

from __future__ import annotations

import contextlib
import os

import torch

from specbench.engine import kvcache
from specbench.engine.packaged import cache_dir
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.errors import SpecbenchError

ENGINES = ("eager", "compiled")  # --engine choices
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # CUDA: rows per forward; prefill runs in chunks of the largest
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


def configure_compiler(device_type: str | None = None) -> None:
    """The compiler's cache in the package's cache folder and no silent eager fallback; with a CPU
    ``device_type``, the CPU graph settings of the tuning level (``CPU_OPTIONS``) too."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), GRAPH_LIMIT))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True
    if device_type is not None and device_type != "cuda" and tuning_level():
        _configure_cpu()


def _forward(model, cache, keyword: str, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                output_hidden_states=True, **{keyword: cache})
    return out.logits, tuple(out.hidden_states)


# On a CPU: weights frozen into the graph (packed for the kernels), the projections that read the same input
# fused into one matmul (q/k/v, gate/up) and a C++ wrapper around the kernels: per-step overhead, not FLOPs, is
# what a small model's decode step spends its time on there. Set in the compiler's own configuration (passed as
# torch.compile options they did not take effect), so for the whole process.
CPU_OPTIONS = {"freezing": True, "cpp_wrapper": True}
# The one-row graph's matmuls are also autotuned between oneDNN and the compiler's own C++ GEMM templates
# (micro-kernels for the CPU's vector unit). Measured on a 2-core AMD Zen 4, SmolLM2-135M vanilla: bf16 22 tok/s
# eager, 39 without, 63 with (the lm_head's one-row matmul 1.1 ms against oneDNN's 2.6); fp32 16, 42 with. Not
# the symbolic-rows graph: tuned at its smallest row count, the templates made a bf16 16-row verify 5.8x a
# one-row step there (oneDNN's bf16 kernels win from about 8 rows).
ONE_ROW_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# SPECBENCH_COMPILE_TUNING: 2 (the default) all of it; 1 without the autotuning (graphs build in about half the
# time: the autotuning benchmarks each matmul shape, and frozen graphs are not kept by the compiler's graph cache,
# so every process builds them again); 0 none (several times faster builds, slower steps: the test suite builds
# hundreds of graphs of tiny models, and the engine's paths are the same either way).
TUNING_ENV = "SPECBENCH_COMPILE_TUNING"
TUNING_LEVELS = ("0", "1", "2")
_COMPILED: dict[str, object] = {}  # device type -> the compiled _forward, one per process (graphs keyed by guards)


def tuning_level() -> int:
    level = os.environ.get(TUNING_ENV, "2").strip()
    if level not in TUNING_LEVELS:
        raise SpecbenchError(f"{TUNING_ENV}={level!r}: use 0 (no CPU tuning), 1 (frozen weights, fused projections, "
                             "C++ wrapper) or 2 (those and the one-row graph's matmuls autotuned, the default)")
    return int(level)


def _configure_cpu() -> None:
    import torch._inductor.config as inductor

    for name, value in CPU_OPTIONS.items():
        setattr(inductor, name, value)
    if hasattr(inductor.cpp, "enable_concat_linear"):
        inductor.cpp.enable_concat_linear = True


def _build_options(device_type: str, key: int):
    """The compiler settings graph ``key`` is built under: the one-row graph of a CPU autotuned at level 2."""
    import torch._inductor.config as inductor

    tuned = device_type != "cuda" and key == 1 and tuning_level() >= 2
    return inductor.patch(ONE_ROW_OPTIONS) if tuned else contextlib.nullcontext()


def _compiled(device_type: str):
    """The compiled forward for ``device_type``: CUDA graphs on a GPU, ``CPU_OPTIONS`` elsewhere. A module-level
    function, not a bound method: a deep copy of a drafter that holds a ``CompiledForward``
    (forced.private_copy) then runs on its own model and cache."""
    if device_type not in _COMPILED:
        if device_type == "cuda":
            _COMPILED[device_type] = torch.compile(_forward, mode="reduce-overhead", dynamic=False)
        else:
            configure_compiler(device_type)
            _COMPILED[device_type] = torch.compile(_forward)
    return _COMPILED[device_type]


class CompiledForward:
    """``model``'s forward over a ``StaticKV`` of at least ``capacity`` columns (grown on demand, up to
    ``max_context``), through few graphs: on CUDA one per bucket of ``BUCKETS`` (rows padded up to it, each
    graph a CUDA graph); on a CPU one for a single row and one for any other count up to ``BUCKETS[-1]`` (the
    row dimension symbolic, nothing padded: a padded row costs real time there). Frozen weights: a model's
    weights must not change once its graphs are built."""

    def __init__(self, model, capacity: int, max_context: int) -> None:
        configure_compiler()
        self.model = model
        weight = model.get_input_embeddings().weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cuda_graphs = self.device.type == "cuda"
        # CPU: plain matmul attention in the graph (the compiler fuses it; SDPA's CPU kernel over the whole static
        # width cost more than the rest of a one-row step); GPU: the model's own (SDPA).
        self.attention = None if self.cuda_graphs else "eager"
        self.keyword = kvcache.cache_keyword(type(model).forward)
        self.max_context = max_context
        self.floor = torch.finfo(self.dtype).min
        self.cache = None  # static_cache.StaticKV
        self._allocate(self._round(capacity))

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
        self.built: set[int] = set()  # graph keys (``graph_key``) built for this cache

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` columns (prompt, new tokens and the widest verify after them)."""
        if tokens > self.cache.capacity:
            self._allocate(self._round(tokens))

    @property
    def width(self) -> int:
        return self.cache.capacity + self.cache.spare

    def rows_for(self, q: int) -> int:
        """Rows a forward of ``q`` runs: its bucket with CUDA graphs, ``q`` itself on a CPU."""
        return bucket(q) if self.cuda_graphs else q

    def graph_key(self, size: int) -> int:
        """Which graph runs ``size`` rows: the bucket's (CUDA); 1 or the symbolic-rows graph, 0 (CPU)."""
        return size if self.cuda_graphs or size == 1 else 0

    def _buffers(self, size: int) -> tuple[torch.Tensor, ...]:
        """(ids [1, n], positions [1, n], mask [1, 1, n, width], slots [n]) for ``size`` rows, reused."""
        if size not in self._inputs:
            d = self.device
            self._inputs[size] = (torch.zeros(1, size, dtype=torch.long, device=d),
                                  torch.zeros(1, size, dtype=torch.long, device=d),
                                  torch.empty(1, 1, size, self.width, dtype=self.dtype, device=d),
                                  torch.zeros(size, dtype=torch.long, device=d))
        return self._inputs[size]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        config = self.model.config
        saved = config._attn_implementation
        if self.attention:
            config._attn_implementation = self.attention
        try:
            return _compiled(self.device.type)(self.model, self.cache, self.keyword, ids, positions, mask)
        finally:
            config._attn_implementation = saved

    def _pad_rows(self, mask: torch.Tensor, slots: torch.Tensor, first: int, size: int) -> None:
        """Rows [first, size) are padding: each writes and sees only its own spare column."""
        if first < size:
            rows = torch.arange(first, size, device=self.device)
            slots[first:] = self.cache.capacity + rows
            mask[0, 0, rows, self.cache.capacity + rows] = 0

    def _build(self, key: int, timer: PhaseTimer) -> None:
        """Build graph ``key`` on dummy rows that touch only spare columns (outside the clock); the symbolic-rows
        graph of a CPU from two rows, its row dimension marked dynamic (2 to the largest bucket)."""
        size = key or 2
        ids, positions, mask, slots = (torch.zeros_like(t) for t in self._buffers(size))
        mask.fill_(self.floor)
        self._pad_rows(mask, slots, 0, size)
        if key == 0:
            for tensor, dim in ((ids, 1), (positions, 1), (mask, 2), (slots, 0)):
                torch._dynamo.mark_dynamic(tensor, dim, min=2, max=BUCKETS[-1])
        with timer.paused("graph_compile"), _build_options(self.device.type, key):
            self.cache.slots = slots
            for _ in range(3 if self.cuda_graphs else 1):  # CUDA graph trees record on a later call
                self._step(ids, positions, mask)
        self.built.add(key)

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

    def run_causal(self, ids: torch.Tensor, start: int, hidden: bool, timer: PhaseTimer = NULL_TIMER
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """``ids`` [n] at positions start.., each seeing everything before it (a prompt, a fed suffix), in chunks
        of ``BUCKETS[-1]`` rows. Returns the last row's logits [1, V] and, with ``hidden``, every hidden state of
        every row [n, H] (HF order)."""
        parts = []
        for first in range(0, ids.shape[0], BUCKETS[-1]):
            chunk, at = ids[first:first + BUCKETS[-1]], start + first
            parts.append(self.run(chunk, torch.arange(at, at + chunk.shape[0], device=self.device), None, at,
                                  hidden, timer))
        states = tuple(torch.cat(layer) for layer in zip(*(p[1] for p in parts))) if hidden else None
        return parts[-1][0][-1:], states

    @torch.no_grad()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, start: int,
            hidden: bool, timer: PhaseTimer = NULL_TIMER) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One forward of ``q`` rows (``ids``, ``positions``: [q] on the device) written at columns
        start..start+q-1; row i sees columns [0, start) and the new rows j with ``visible[i, j]`` (None:
        causal). Returns logits [q, V] and, with ``hidden``, every hidden state [q, H] (HF order)."""
        q = ids.shape[0]
        if q > BUCKETS[-1]:
            raise SpecbenchError(f"the compiled engine runs at most {BUCKETS[-1]} rows per forward ({q} asked); "
                                 "lower the tree budget or use --engine eager")
        if start + q > self.cache.capacity:
            self.reserve(start + q)
        size = self.rows_for(q)
        if self.graph_key(size) not in self.built:
            self._build(self.graph_key(size), timer)
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
        logits, states = self._step(x, pos, mask)
        self.cache.rows = start + q
        logits = logits[0, :q]
        states = tuple(h[0, :q] for h in states) if hidden else None
        if self.cuda_graphs:  # a graph's outputs are overwritten by its next replay
            logits = logits.clone()
            states = tuple(h.clone() for h in states) if states is not None else None
        return logits, states
