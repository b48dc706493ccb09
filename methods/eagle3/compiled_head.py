"""EAGLE-3's head in the compiled engine: one preallocated key/value buffer and three compiled forwards.

Eagerly the head concatenates its cache at every forward: the committed rows, then each tree level's ten rows,
a fresh tensor per level, and the framework's per-call overhead dominates a one-layer forward of ten rows. Under
``--engine compiled`` (docs/methods.md#eagle-3) its keys and values live in one buffer per K and V of fixed width,
[1, kv_heads, capacity + spare, head_dim]: committed rows at columns [0, rows), a proposal's tree levels right
after them (the eager layout, so a node sees the same keys in the same order), and a build's dummy rows in the
spare columns past ``capacity``, which no real row sees. Tree rows are never kept: the next encode overwrites them.

Three graphs, each built once on dummy rows outside the clock (``PhaseTimer.paused("graph_compile")``): the
encode of one new committed row, of two or more (the row count symbolic: a prompt, an accepted path), and a tree
level of ``top_k`` rows. The encode graphs return the last row's draft log-probabilities, the level graph every
row's, so the lm_head over the draft vocabulary runs inside the graph too. The buffer grows (and the graphs are
built again) only if a request outgrows the target's reserved context.
"""

from __future__ import annotations

import torch

from methods.layers import repeat_kv
from specbench.engine.compiled_forward import CAPACITY_STEP, configure_compiler
from specbench.engine.timing import NULL_TIMER, PhaseTimer

_COMPILED: dict[tuple[str, str], object] = {}  # (device type, graph) -> its compiled function, one per process


def log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary log-probabilities; clamped at 0 so that scores never rise along a path (select_nodes)."""
    return model.logits(hidden).float().log_softmax(-1).clamp(max=0.0)


def head_step(model, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor,
              positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, last_only: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``Eagle3Model.forward`` over the static buffers: the new rows' keys and values are written at ``slots``
    and every row attends over the whole width through ``mask`` (additive, [1, 1, N, width]). Returns the output
    hidden [1, N, H] and the log-probabilities of the last row (``last_only``) or of every row."""
    hidden = model.fuse(hidden)
    cos, sin = model.rotary(positions, hidden.dtype)
    layer = model.midlayer
    attn = layer.self_attn
    x = layer.attention_input(hidden, model.embed(ids))
    q = attn.queries(x, cos, sin)
    k, v = attn.keys_values(x, cos, sin)
    keys.index_copy_(2, slots, k)
    values.index_copy_(2, slots, v)
    # Plain matmul attention: the compiler fuses it, and a CPU's SDPA kernel over the whole width costs more.
    scores = q @ repeat_kv(keys, attn.groups).transpose(-1, -2) * attn.head_dim ** -0.5 + mask
    weights = scores.float().softmax(-1).to(q.dtype)
    out = layer.finish(hidden, attn.output(weights @ repeat_kv(values, attn.groups)))
    return out, log_probs(model, out[:, -1:] if last_only else out)


def _one_row(*args):
    return head_step(*args)


def _rows(*args):
    return head_step(*args)


def _level(*args):
    return head_step(*args)


# One function per graph: the compiler keeps its cache and its record of the shapes seen per code object, so
# the shapes of one graph's calls never make another's dimensions dynamic (a recompile inside the clock).
_GRAPHS = {"one": _one_row, "many": _rows, "level": _level}


def _compiled(device_type: str, key: str):
    """The compiled function of graph ``key``: module level (not a bound method), so a deep copy of the drafter
    runs its own model; the symbolic-rows graph dynamic where its build marked it, the others static."""
    if (device_type, key) not in _COMPILED:
        configure_compiler(device_type)
        _COMPILED[device_type, key] = torch.compile(_GRAPHS[key], dynamic=None if key == "many" else False)
    return _COMPILED[device_type, key]


class CompiledHead:
    """The head's static buffers and graphs for one request at a time; ``rows`` counts the committed columns."""

    def __init__(self, model, top_k: int, depth: int) -> None:
        self.model, self.top_k, self.depth = model, top_k, depth
        self.spare = max(top_k, 2)  # columns past the capacity for a build's dummy rows (a level's, or two)
        self.device, self.dtype = model.fc.weight.device, model.dtype
        self.floor = torch.finfo(self.dtype).min
        self.capacity, self.rows = 0, 0
        self.built: set[str] = set()

    @property
    def width(self) -> int:
        return self.capacity + self.spare

    def reset(self, context: int) -> None:
        """A new request whose committed positions stay within ``context`` (the target's reserved columns)."""
        self.rows = 0
        self.reserve(context)

    def reserve(self, committed: int) -> None:
        """Room for ``committed`` positions and a full proposal's tree levels after them."""
        needed = committed + self.top_k * self.depth
        if needed <= self.capacity:
            return
        capacity = -(-needed // CAPACITY_STEP) * CAPACITY_STEP
        cfg = self.model.config
        shape = (1, cfg.num_key_value_heads, capacity + self.spare, cfg.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:  # growing mid-request: the committed rows move over
            keys[:, :, :self.rows] = self.keys[:, :, :self.rows]
            values[:, :, :self.rows] = self.values[:, :, :self.rows]
        self.keys, self.values, self.capacity = keys, values, capacity
        self.built = set()  # a new width: every graph is built again

    def _graph(self, rows: int, own_hidden: bool) -> str:
        return "level" if own_hidden else ("one" if rows == 1 else "many")

    def _build(self, key: str, timer: PhaseTimer) -> None:
        """Build graph ``key`` on dummy rows that write and see only spare columns."""
        rows = {"one": 1, "many": 2, "level": self.top_k}[key]
        width = self.model.config.hidden_size if key == "level" else self.model.fc.in_features
        hidden = torch.zeros(1, rows, width, dtype=self.dtype, device=self.device)
        ids = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        positions = torch.zeros_like(ids)
        slots = self.capacity + torch.arange(rows, device=self.device)
        mask = torch.full((1, 1, rows, self.width), self.floor, dtype=self.dtype, device=self.device)
        mask[0, 0, torch.arange(rows), slots] = 0
        if key == "many":
            for tensor, dim in ((hidden, 1), (ids, 1), (positions, 1), (mask, 2), (slots, 0)):
                torch._dynamo.mark_dynamic(tensor, dim, min=2, max=self.capacity)
        with timer.paused("graph_compile"):
            _compiled(self.device.type, key)(self.model, self.keys, self.values, hidden, ids, positions, slots, mask,
                                             key != "level")
        self.built.add(key)

    def _run(self, hidden, ids, positions, start: int, visible: torch.Tensor, last_only: bool, timer: PhaseTimer):
        n = ids.shape[1]
        key = self._graph(n, not last_only)
        if key not in self.built:
            self._build(key, timer)
        slots = torch.arange(start, start + n, device=self.device)
        mask = torch.full((1, 1, n, self.width), self.floor, dtype=self.dtype, device=self.device)
        mask[0, 0, :, :start + n].masked_fill_(visible, 0)
        return _compiled(self.device.type, key)(self.model, self.keys, self.values, hidden, ids, positions, slots,
                                                mask, last_only)

    @torch.no_grad()
    def encode(self, features: torch.Tensor, ids: torch.Tensor, timer: PhaseTimer = NULL_TIMER
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed pairs (features [N, 3H], next tokens [N]) after the ``rows`` encoded so far; returns the
        last row's output hidden [H] and draft log-probabilities [draft V]."""
        n, start = ids.shape[0], self.rows
        self.reserve(start + n)
        positions = torch.arange(start, start + n, device=self.device)[None]
        visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril_(diagonal=start)
        out, logp = self._run(features[None].contiguous(), ids[None], positions, start, visible, True, timer)
        self.rows = start + n
        return out[0, -1], logp[0, -1]

    @torch.no_grad()
    def level(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
              timer: PhaseTimer = NULL_TIMER) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree level of ``top_k`` nodes (parents' output hidden [k, H], target ids [k], positions [1, k]) written
        after the committed rows and the earlier levels; ``visible`` [k, columns so far + k] says what each node
        sees (``Eagle3Drafter._level`` builds it for both engines). Returns the output hidden [k, H] and draft
        log-probabilities [k, draft V]."""
        k = ids.shape[0]
        start = visible.shape[1] - k
        # contiguous: the first level's parents are one row expanded, and a graph is specialised to its strides
        out, logp = self._run(hidden[None].contiguous(), ids[None], positions, start, visible, False, timer)
        return out[0], logp[0]
