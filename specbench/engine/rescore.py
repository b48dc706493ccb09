"""Re-scoring a greedy flip: what exact arithmetic says at the first position where a method's text left
vanilla's, and where correct forwards in the run's dtype land there (the exact rule of
``specbench/divergence.py``, whose docstring defines the figures).

The reference forwards are the model's own forward called plainly: positions, tree masks and cache
truncation are built here, never by ``Target.compile_tree``, ``verify``, ``commit`` or the cache
compaction, so that a bug in the engine's verify path cannot make its own reference. They run on a view of
the run's model with a cache of their own (the run's target and its cache are left as they were); the
exact forward runs on an upcast copy of the run's model, made once, at the first flip (``Rescorer.exact``).
A flip of a batched record is also replayed in batched shapes (``PlainBatch``): the right-padded cache, its
dead columns, the padded rows, the positions per request and the additive mask are built here too, never by
``pack_rows``, ``BatchTarget`` or ``RaggedCache``."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch

from specbench import divergence
from specbench.engine import kvcache
from specbench.engine.target import Target
from specbench.errors import SpecbenchError

VERIFY_ROWS = (1, 2, 4, 8, 16)  # rows of the verifies whose last path row is the flip's position
BATCH_ROWS = (1, 2, 4)  # rows per verify of the batched replays (1: vanilla's batched decode)
EXACT_DTYPES = {"float32": torch.float32, "float64": torch.float64}  # what the exact forward may run in


def _gap(row: torch.Tensor, a: int, b: int) -> float:
    """l[a] − l[b] of one logit row, as the float the row's dtype holds."""
    return float(row[a].float() - row[b].float())


@contextmanager
def _full_float32_matmuls():
    """No TF32 (nor bf16) shortcuts in float32 matmuls while the exact forward runs."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass(frozen=True)
class Rows:
    """One request's rows of a forward, [root, path..., leaves...] (``block``): their tokens, depths below the
    root, which rows each row sees ([q, q] bool: its ancestors and itself) and how many the cache keeps (the
    first ``keep``)."""

    tokens: list[int]
    depth: list[int]
    seen: torch.Tensor
    keep: int

    @property
    def is_chain(self) -> bool:
        return self.depth == list(range(len(self.depth)))


def block(root: int, path: Sequence[int] = (), leaves: Sequence[int] = (), leaf_parent: int = 0,
          keep: int | None = None) -> Rows:
    """Rows [root, path..., leaves...]: the path a chain under the root, each leaf a child of row ``leaf_parent``;
    the cache keeps root and path unless ``keep`` says otherwise."""
    tokens = [int(root), *map(int, path), *map(int, leaves)]
    k = len(path) + 1  # root and path
    seen = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
    for r in range(len(tokens)):
        seen[r, :(r if r < k else leaf_parent) + 1] = True
        seen[r, r] = True
    return Rows(tokens, list(range(k)) + [leaf_parent + 1] * len(leaves), seen, k if keep is None else keep)


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a bool visibility: 0 where seen, the dtype's most negative value elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)


class PlainForwards:
    """The model's forward on a cache of its own, as the engine calls it (the same kernels: no mask for a
    chain, an additive 4-D mask for a tree), with positions, masks and truncations made here. Rows of a
    forward are [root, path..., leaves...] (``block``); ``keep(n)`` keeps the first n rows in the cache."""

    def __init__(self, view: Target) -> None:
        self.view = view
        self.length = 0

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt's forward; the last row's logits (the engine keeps only that row too)."""
        view = self.view
        view.reset()
        tokens = torch.tensor([[int(t) for t in ids]], device=view.device)
        positions = torch.arange(tokens.shape[1], device=view.device).unsqueeze(0)
        self.length = tokens.shape[1]
        return view._forward(tokens, positions, None, (), keep_last=True).logits[-1]

    def run(self, rows: Rows) -> torch.Tensor:
        """One forward of ``rows`` after the cache; every row's logits."""
        view, past = self.view, self.length
        positions = torch.tensor([[past + d for d in rows.depth]], device=view.device)
        ids = torch.tensor([rows.tokens], device=view.device)
        mask = None
        if not rows.is_chain:  # a tree: each row sees the cache, its ancestors and itself
            seen = torch.cat([torch.ones(len(rows.tokens), past, dtype=torch.bool), rows.seen], 1)
            mask = _additive(seen, view.dtype).to(view.device)[None, None]
        return view._forward(ids, positions, mask, (), keep_last=False).logits

    def rows(self, root: int, path: Sequence[int], leaves: Sequence[int] = (), leaf_parent: int = 0) -> torch.Tensor:
        """One forward of [root, path..., leaves...] after the cache; every row's logits."""
        return self.run(block(root, path, leaves, leaf_parent))

    def keep(self, rows: int) -> None:
        """Keep the first ``rows`` rows of the last forward (root and path come first: a plain truncation)."""
        self.length += rows
        kvcache.truncate(self.view.cache, self.length)


class PlainBatch:
    """B requests verified in ONE forward over a right-padded cache, the way the batched loop verifies them,
    built here by hand (not by ``pack_rows`` or ``RaggedCache``, whose bugs it must not share). Each request's
    committed keys and values are kept apart (its prompt prefilled at batch 1, as a request joins a batch)
    and laid side by side before every forward, zero (dead) columns right of the shorter ones up to the
    longest (``width``); the rows [B, Q] are padded to the widest request's with copies of its root that see
    only the cache and themselves, each request's positions count from its own length, and the additive
    [B, 1, Q, width + Q] mask lets a row see its own request's committed columns and its ancestors only."""

    def __init__(self, view: Target, prompts: Sequence[Sequence[int]]) -> None:
        self.view = view
        self.kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per request, per layer: [1, heads, n, d]
        self.lengths: list[int] = []
        for prompt in prompts:
            PlainForwards(view).prefill(prompt)
            self.kv.append(kvcache.pairs(view.cache))
            self.lengths.append(len(prompt))
        view.reset()

    def copy(self) -> "PlainBatch":
        """The same requests at their prefilled lengths, for another replay (``run`` rebinds, never writes into, the
        tensors it was given, so the prefills are shared, not redone)."""
        twin = copy.copy(self)
        twin.kv, twin.lengths = list(self.kv), list(self.lengths)
        return twin

    def inputs(self, blocks: Sequence[Rows]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B, Q], positions [B, Q], seen [B, Q, width + Q] bool) of one forward, on the host."""
        width, q = max(self.lengths), max(len(rows.tokens) for rows in blocks)
        ids = torch.zeros(len(blocks), q, dtype=torch.long)
        positions = torch.zeros_like(ids)
        seen = torch.zeros(len(blocks), q, width + q, dtype=torch.bool)
        for b, (rows, length) in enumerate(zip(blocks, self.lengths)):
            n = len(rows.tokens)
            ids[b, :n], ids[b, n:] = torch.tensor(rows.tokens), rows.tokens[0]
            positions[b, :n], positions[b, n:] = length + torch.tensor(rows.depth), length
            seen[b, :, :length] = True  # its committed columns; [length, width) are dead for it
            seen[b, :n, width:width + n] = rows.seen
            seen[b, range(n, q), range(width + n, width + q)] = True  # a padding row: itself only
        return ids, positions, seen

    @torch.inference_mode()  # the prefills' caches are inference tensors
    def run(self, blocks: Sequence[Rows]) -> torch.Tensor:
        """One forward of every request's ``blocks[b]``; each request then keeps its first ``keep`` rows.
        Returns the logits [B, Q, vocab]."""
        from transformers import DynamicCache

        view, width = self.view, max(self.lengths)
        ids, positions, seen = self.inputs(blocks)
        cache = DynamicCache()
        for layer, per_request in enumerate(zip(*self.kv)):
            keys, values = (torch.cat([_right_pad(kv[i], width) for kv in per_request]) for i in (0, 1))
            cache.update(keys, values, layer)
        mask = _additive(seen, view.dtype)[:, None].to(view.device)
        out = view.model(input_ids=ids.to(view.device), position_ids=positions.to(view.device), attention_mask=mask,
                         use_cache=True, **kvcache.cache_arg(view.model, cache))
        grown = kvcache.pairs(cache)
        for b, rows in enumerate(blocks):
            cols = slice(width, width + rows.keep)
            self.kv[b] = [(torch.cat([k, keys[b:b + 1, :, cols]], 2), torch.cat([v, values[b:b + 1, :, cols]], 2))
                          for (k, v), (keys, values) in zip(self.kv[b], grown)]
            self.lengths[b] += rows.keep
        return out.logits


def _right_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [1, heads, n, d] with zero columns up to ``width`` (finite: a dead key still enters q.k)."""
    return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))


def exact_logits(exact: Target, prefix: Sequence[int], a: int, b: int) -> tuple[float, float]:
    """(l[a], l[b]) of the row after ``prefix``: one plain causal forward of the whole prefix."""
    with _full_float32_matmuls():
        row = PlainForwards(exact).prefill(prefix)
    return float(row[a]), float(row[b])


def decode_gap(plain: PlainForwards, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int,
               b: int) -> tuple[float, int]:
    """Vanilla's way to ``position``: the prompt's prefill, then one one-row step per committed token.
    Returns (the gap at ``position``, how many of the replay's argmaxes differ from ``tokens[:position]`` and
    vanilla's token ``b``: 0 where the replay reproduces the run)."""
    row = plain.prefill(prompt_ids)
    differ = 0
    for token in tokens[:position]:
        differ += int(row.argmax()) != int(token)
        row = plain.rows(token, ())[-1]
        plain.keep(1)
    return _gap(row, a, b), differ + (int(row.argmax()) != b)


def _method_steps(tokens: Sequence[int], position: int, a: int, tree_sizes: Sequence[int],
                  accept_lengths: Sequence[int], masked: bool) -> list[Rows]:
    """The method's verifies up to the one that chose ``position`` (``steps_gap``), each keeping its path;
    empty when the record's verifies do not reach ``position``."""
    steps, start = [], 0  # start: the index in ``tokens`` of the next verify's root (token 0 came from the prefill)
    for size, accepted in zip(tree_sizes, accept_lengths):
        end = start + accepted + 1  # the verify commits tokens[start..end] (its bonus is tokens[end])
        path = [int(t) for t in tokens[start:min(position, end)]]
        filler = [a] * max(0, size + 1 - len(path))  # the rejected nodes: their tokens change no path row
        if masked:
            steps.append(block(path[0], path[1:], filler, leaf_parent=0))
        else:
            steps.append(block(path[0], path[1:] + filler, keep=len(path)))
        if position <= end:
            return steps
        start = end
    return []


def steps_gap(plain: PlainForwards, prompt_ids: Sequence[int], steps: Sequence[Rows], a: int, b: int) -> float:
    """The method's own shapes replayed correctly (``_method_steps``: per verify of its record a forward of as
    many rows, its committed tokens as the path, the rest as leaves under the root, or as the chain's tail when
    it never drafted a tree, the path kept): the prompt's prefill, then those verifies; the gap at the position
    the last of them chose."""
    plain.prefill(prompt_ids)
    for rows in steps:
        logits = plain.run(rows)
        plain.keep(rows.keep)
    return _gap(logits[steps[-1].keep - 1], a, b)


def _chunks(tokens: Sequence[int], position: int, rows: int) -> list[list[int]]:
    """The committed tokens before ``position`` in verifies of ``rows`` rows each, the first shorter so that
    the last ends at ``position`` (the row of token j predicts token j + 1)."""
    committed = [int(t) for t in tokens[:position]]
    first = position % rows or rows
    return [committed[:first]] + [committed[k:k + rows] for k in range(first, position, rows)]


def _stepped(tokens: Sequence[int], position: int, rows: int, leaves: Sequence[int]) -> list[Rows]:
    """The committed tokens before ``position`` as verifies of ``rows`` rows each (``_chunks``), ``leaves`` (if any)
    children of each path's last row; each keeps its path."""
    return [block(chunk[0], chunk[1:], leaves, leaf_parent=len(chunk) - 1) for chunk in _chunks(tokens, position, rows)]


def stepped_gaps(plain: PlainForwards, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, rows: int,
                 a: int, b: int) -> dict[str, float]:
    """The gap at ``position`` with the cache built as a method with a steady acceptance builds it: the
    prompt's prefill, then the committed tokens through verifies of ``rows`` rows each (the first shorter, so
    that the last ends at ``position``), every row kept; as chains (``chain_r``) and as trees with a and b as
    two leaves under each path's last row (``tree_r``)."""
    return {f"{name}_{rows}": steps_gap(plain, prompt_ids, _stepped(tokens, position, rows, leaves), a, b)
            for name, leaves in (("chain", ()), ("tree", (a, b)))}


def neighbour_prompts(prompt_ids: Sequence[int], count: int) -> list[list[int]]:
    """``count`` neighbours for a batched replay: copies of the prompt longer and shorter by turns (+3, −3,
    +6, −6, ... tokens; a longer copy repeats the prompt's first tokens ahead of it, a shorter one drops them
    and keeps one token at least), so that our request has dead columns right of its keys (a longer
    neighbour) and the shorter neighbours have theirs, as prompts of different lengths leave them."""
    prompt = [int(t) for t in prompt_ids]
    out = []
    for j in range(count):
        shift = 3 * (j // 2 + 1)
        out.append((prompt * (shift // len(prompt) + 1))[:shift] + prompt if j % 2 == 0
                   else prompt[min(shift, len(prompt) - 1):])
    return out


def neighbour_batch(view: Target, prompt_ids: Sequence[int], size: int) -> tuple[PlainBatch, int]:
    """Our prompt and ``size`` − 1 neighbours (``neighbour_prompts``) prefilled as a ``PlainBatch``, and our index in
    it (neither first nor last where B > 2); every batched replay of a flip starts from a copy of it."""
    ours = size // 2
    prompts = neighbour_prompts(prompt_ids, size - 1)
    prompts.insert(ours, [int(t) for t in prompt_ids])
    return PlainBatch(view, prompts), ours


def batched_replay(prefilled: PlainBatch, ours: int, steps: Sequence[Rows]) -> torch.Tensor:
    """Our request's verifies ``steps`` in the batch ``prefilled`` (a copy of it): each in ONE forward beside the
    neighbours, which verify the same root and path as a chain at their own positions (so a tree of ours pads
    their rows); the logits of our rows in the last forward."""
    batch = prefilled.copy()
    for rows in steps:
        chain = block(rows.tokens[0], rows.tokens[1:rows.keep])
        logits = batch.run([rows if b == ours else chain for b in range(len(batch.lengths))])
    return logits[ours]


def batched_gaps(prefilled: PlainBatch, ours: int, tokens: Sequence[int], position: int, rows: int, a: int,
                 b: int) -> dict[str, float]:
    """``stepped_gaps`` in the batch ``prefilled`` of B requests (``batched_replay``): the committed tokens through
    verifies of ``rows`` rows each, as chains (``batch{B}_chain_r``; r = 1 is vanilla's batched decode) and, for
    r > 1, as trees with a and b as two leaves under each path's last row (``batch{B}_tree_r``)."""
    out = {}
    for name, leaves in (("chain", ()), ("tree", (a, b)))[:1 if rows == 1 else 2]:
        logits = batched_replay(prefilled, ours, _stepped(tokens, position, rows, leaves))
        out[f"batch{len(prefilled.lengths)}_{name}_{rows}"] = _gap(logits[rows - 1], a, b)
    return out


def batch_sizes(batch: dict | None) -> list[int]:
    """The batch sizes a batched record's flip is replayed in: its batch size and, where requests left before
    it ended (a static batch drains), its mean number of active requests rounded; none above 1: none."""
    if not batch:
        return []
    size, mean = int(batch.get("size") or 1), round(float(batch.get("active_mean") or 0))
    return [s for s in dict.fromkeys([size, mean]) if s > 1]


def prefill_gaps(plain: PlainForwards, prefix: Sequence[int], rows: int, a: int, b: int) -> dict[str, float]:
    """The gap at the row after ``prefix`` from verifies of its last ``rows`` tokens after one prefill of the
    rest: as a chain (the causal kernel) and as a tree with a and b as two leaves under the path's last row
    (the masked kernel): ``prefill_chain_r``, ``prefill_tree_r``."""
    root, path = int(prefix[-rows]), [int(t) for t in prefix[len(prefix) - rows + 1:]]
    out = {}
    for name, leaves in (("chain", ()), ("tree", (a, b))):
        plain.prefill(prefix[:-rows])
        logits = plain.rows(root, path, leaves, leaf_parent=len(path))
        out[f"prefill_{name}_{rows}"] = _gap(logits[rows - 1], a, b)
    return out


class Rescorer:
    """Re-scores flips of one target: correct forwards in the target's dtype on a view of its model, and
    the exact forward on a copy upcast to ``exact_dtype`` (made at the first call, then kept).

    What a flip's figures owe only to its context (the prompt, the tokens before it, the two tokens) is
    computed once per context and kept (``_context``): the sides of a run, and the files of one target, part
    from vanilla at the same near-ties again and again (578 first flips of the reference set's bf16 files on
    SmolLM2-135M come from 151 contexts). Only the method's own verify shapes, and the batched replays, are
    replayed per record. The forwards are deterministic, so a kept figure is the one a new forward gives."""

    def __init__(self, target: Target, exact_dtype: str = "float32") -> None:
        if exact_dtype not in EXACT_DTYPES:
            raise SpecbenchError(f"the exact forward runs in {' or '.join(EXACT_DTYPES)} (got {exact_dtype!r})")
        self.target = target
        self.exact_dtype = exact_dtype
        self.view = Target(target.model, None, target.name)  # the same weights, a cache of its own
        self.view.chain_attn = target.chain_attn
        self._exact: Target | None = None
        self._contexts: dict[tuple, dict] = {}  # ``_context``'s figures by (prompt, tokens before the flip, a, b)

    @property
    def exact(self) -> Target:
        """The run's model upcast (its own weights' values, so e differs from its forwards by rounding only)."""
        if self._exact is None:
            model = copy.deepcopy(self.target.model).to(EXACT_DTYPES[self.exact_dtype])
            self._exact = Target(model, None, f"{self.target.name} ({self.exact_dtype})")
        return self._exact

    def rescore(self, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int, b: int,
                shapes: dict | None = None) -> dict:
        """The figures of the flip at ``position`` (method token ``a``, vanilla token ``b``) after ``prompt_ids``
        and the committed ``tokens`` before it: exact_margin, exact_logits, exact_dtype, gaps and
        replay_mismatches (``decode_gap``). ``shapes``: the method record's ``tree_sizes``,
        ``accept_lengths`` and ``chain_calls``, whose verifies ``steps_gap`` replays, and its ``batch``
        (a batched record: the same replays in its batch shapes, ``batch_sizes``)."""
        context = self._context(prompt_ids, tokens, position, a, b)
        plain = PlainForwards(self.view)
        gaps = {"decode": context["decode"]}
        steps: list[Rows] = []
        if shapes and position > 0:
            sizes, accepts = shapes["tree_sizes"], shapes["accept_lengths"]
            masked = shapes.get("chain_calls", -1) != len(sizes)  # a tree at least once (or not recorded)
            steps = _method_steps(tokens, position, a, sizes, accepts, masked)
            if steps:  # None of the record's verifies reach ``position``: no method gap
                gaps["method"] = steps_gap(plain, prompt_ids, steps, a, b)
        gaps.update(context["gaps"])
        for size in batch_sizes((shapes or {}).get("batch")) if position > 0 else ():  # a prefill is batch 1's
            gaps.update(self.batched(prompt_ids, tokens, position, a, b, size, steps))
        self.view.reset()  # the cache is not kept between flips
        la, lb = context["exact_logits"]
        return {"exact_margin": la - lb, "exact_logits": [la, lb], "exact_dtype": self.exact_dtype,
                "gaps": gaps, "replay_mismatches": context["replay_mismatches"]}

    def _context(self, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int, b: int) -> dict:
        """The figures of a flip that its context alone decides, computed at its first flip and then kept: the
        exact logits, vanilla's decode replayed (its gap and mismatches), the stepped and prefill gaps."""
        key = (tuple(int(t) for t in prompt_ids), tuple(int(t) for t in tokens[:position]), int(a), int(b))
        if key in self._contexts:
            return self._contexts[key]
        prefix = [*key[0], *key[1]]
        exact = exact_logits(self.exact, prefix, a, b)
        self.exact.reset()
        plain = PlainForwards(self.view)
        decode, differ = decode_gap(plain, prompt_ids, tokens, position, a, b)
        gaps: dict[str, float] = {}
        for rows in VERIFY_ROWS:
            if 1 < rows <= position:  # one row at a time: the decode steps
                gaps.update(stepped_gaps(plain, prompt_ids, tokens, position, rows, a, b))
        for rows in VERIFY_ROWS:
            if rows < len(prefix):  # the prefill before the verify needs one token at least
                gaps.update(prefill_gaps(plain, prefix, rows, a, b))
        self.view.reset()
        self._contexts[key] = {"exact_logits": exact, "decode": decode, "replay_mismatches": differ, "gaps": gaps}
        return self._contexts[key]

    def batched(self, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int, b: int, size: int,
                steps: Sequence[Rows] = ()) -> dict[str, float]:
        """The gaps at ``position`` from forwards in a batch of ``size``: the method's verifies ``steps``
        (``batch{B}_method``) and ``batched_gaps`` for r in ``BATCH_ROWS``."""
        gaps = {}
        prefilled, ours = neighbour_batch(self.view, prompt_ids, size)  # B prefills, shared by every replay below
        if steps:
            logits = batched_replay(prefilled, ours, steps)
            gaps[f"batch{size}_method"] = _gap(logits[steps[-1].keep - 1], a, b)
        for rows in BATCH_ROWS:
            if rows <= position:
                gaps.update(batched_gaps(prefilled, ours, tokens, position, rows, a, b))
        return gaps

    def judge(self, entry: dict, prompt_ids: Sequence[int], record) -> dict:
        """A first flip's divergence entry (``divergence.classify``) of the method turn ``record`` (its tokens
        and verify shapes) with the exact rule's verdict."""
        shapes = {"tree_sizes": record.tree_sizes, "accept_lengths": record.accept_lengths,
                  "chain_calls": record.chain_calls, "batch": getattr(record, "batch", None)}
        found = self.rescore(prompt_ids, record.new_tokens, entry["position"], entry["method_token"],
                             entry["vanilla_token"], shapes)
        out = divergence.exact_verdict(entry, found["exact_margin"], found["exact_logits"], found["gaps"],
                                       self.target.dtype, found["exact_dtype"])
        out["replay_mismatches"] = found["replay_mismatches"]
        return out
