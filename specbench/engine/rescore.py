"""Re-scoring a greedy flip: what exact arithmetic says at the first position where a method's text left
vanilla's, and where correct forwards in the run's dtype land there (the exact rule of
``specbench/divergence.py``, whose docstring defines the figures).

The reference forwards are the model's own forward called plainly: positions, tree masks and cache
truncation are built here, never by ``Target.compile_tree``, ``verify``, ``commit`` or the cache
compaction, so that a bug in the engine's verify path cannot make its own reference. They run on a view of
the run's model with a cache of their own (the run's target and its cache are left as they were); the
exact forward runs on an upcast copy of the run's model, made once, at the first flip (``Rescorer.exact``)."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Sequence

import torch

from specbench import divergence
from specbench.engine import kvcache
from specbench.engine.target import Target
from specbench.errors import SpecbenchError

VERIFY_ROWS = (1, 2, 4, 8, 16)  # rows of the verifies whose last path row is the flip's position
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


class PlainForwards:
    """The model's forward on a cache of its own, as the engine calls it (the same kernels: no mask for a
    chain, an additive 4-D mask for a tree), with positions, masks and truncations made here. Rows of a
    forward are [root, path..., leaves...]: the path a chain under the root, each leaf a child of row
    ``leaf_parent``; ``keep(n)`` keeps the first n rows (root and path) in the cache."""

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

    def rows(self, root: int, path: Sequence[int], leaves: Sequence[int] = (), leaf_parent: int = 0) -> torch.Tensor:
        """One forward of [root, path..., leaves...] after the cache; every row's logits."""
        view, past = self.view, self.length
        tokens = [int(root), *map(int, path), *map(int, leaves)]
        k = len(path) + 1  # root and path
        depth = list(range(k)) + [leaf_parent + 1] * len(leaves)
        positions = torch.tensor([[past + d for d in depth]], device=view.device)
        ids = torch.tensor([tokens], device=view.device)
        mask = None
        if leaves:  # a tree: each row sees the cache, its ancestors and itself
            seen = torch.zeros(len(tokens), past + len(tokens), dtype=torch.bool)
            seen[:, :past] = True
            for r in range(len(tokens)):
                last = r if r < k else leaf_parent
                seen[r, past:past + last + 1] = True
                seen[r, past + r] = True
            mask = torch.zeros(seen.shape, dtype=view.dtype)
            mask.masked_fill_(~seen, torch.finfo(view.dtype).min)
            mask = mask.to(view.device)[None, None]
        return view._forward(ids, positions, mask, (), keep_last=False).logits

    def keep(self, rows: int) -> None:
        """Keep the first ``rows`` rows of the last forward (root and path come first: a plain truncation)."""
        self.length += rows
        kvcache.truncate(self.view.cache, self.length)


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


def method_gap(plain: PlainForwards, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int,
               b: int, tree_sizes: Sequence[int], accept_lengths: Sequence[int], masked: bool) -> float | None:
    """The method's own shapes replayed correctly: the prompt's prefill, then per verify of its record a
    forward of as many rows (its committed tokens as the path, the rest as leaves under the root, or as the
    chain's tail when ``masked`` is False), the path kept; the gap at ``position`` from the verify that chose
    it. None when the record's verifies do not reach ``position``."""
    plain.prefill(prompt_ids)
    start = 0  # the index in ``tokens`` of the next verify's root (token 0 came from the prefill)
    for size, accepted in zip(tree_sizes, accept_lengths):
        end = start + accepted + 1  # the verify commits tokens[start..end] (its bonus is tokens[end])
        path = [int(t) for t in tokens[start:min(position, end)]]
        filler = [a] * max(0, size + 1 - len(path))  # the rejected nodes: their tokens change no path row
        if masked:
            logits = plain.rows(path[0], path[1:], filler, leaf_parent=0)
        else:
            logits = plain.rows(path[0], path[1:] + filler)
        if position <= end:
            return _gap(logits[len(path) - 1], a, b)
        plain.keep(len(path))
        start = end
    return None


def stepped_gaps(plain: PlainForwards, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, rows: int,
                 a: int, b: int) -> dict[str, float]:
    """The gap at ``position`` with the cache built as a method with a steady acceptance builds it: the
    prompt's prefill, then the committed tokens through verifies of ``rows`` rows each (the first shorter, so
    that the last ends at ``position``), every row kept; as chains (``chain_r``) and as trees with a and b as
    two leaves under each path's last row (``tree_r``)."""
    committed = [int(t) for t in tokens[:position]]  # the row of token j predicts token j + 1
    first = position % rows or rows
    chunks = [committed[:first]] + [committed[k:k + rows] for k in range(first, position, rows)]
    out = {}
    for name, leaves in (("chain", ()), ("tree", (a, b))):
        plain.prefill(prompt_ids)
        for chunk in chunks:
            logits = plain.rows(chunk[0], chunk[1:], leaves, leaf_parent=len(chunk) - 1)
            plain.keep(len(chunk))
        out[f"{name}_{rows}"] = _gap(logits[rows - 1], a, b)
    return out


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
    the exact forward on a copy upcast to ``exact_dtype`` (made at the first call, then kept)."""

    def __init__(self, target: Target, exact_dtype: str = "float32") -> None:
        if exact_dtype not in EXACT_DTYPES:
            raise SpecbenchError(f"the exact forward runs in {' or '.join(EXACT_DTYPES)} (got {exact_dtype!r})")
        self.target = target
        self.exact_dtype = exact_dtype
        self.view = Target(target.model, None, target.name)  # the same weights, a cache of its own
        self.view.chain_attn = target.chain_attn
        self._exact: Target | None = None

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
        ``accept_lengths`` and ``chain_calls``, whose verifies ``method_gap`` replays."""
        prefix = [int(t) for t in prompt_ids] + [int(t) for t in tokens[:position]]
        la, lb = exact_logits(self.exact, prefix, a, b)
        plain = PlainForwards(self.view)
        gap, differ = decode_gap(plain, prompt_ids, tokens, position, a, b)
        gaps = {"decode": gap}
        if shapes and position > 0:
            sizes, accepts = shapes["tree_sizes"], shapes["accept_lengths"]
            masked = shapes.get("chain_calls", -1) != len(sizes)  # a tree at least once (or not recorded)
            found = method_gap(plain, prompt_ids, tokens, position, a, b, sizes, accepts, masked)
            if found is not None:
                gaps["method"] = found
        for rows in VERIFY_ROWS:
            if 1 < rows <= position:  # one row at a time: the decode steps
                gaps.update(stepped_gaps(plain, prompt_ids, tokens, position, rows, a, b))
        for rows in VERIFY_ROWS:
            if rows < len(prefix):  # the prefill before the verify needs one token at least
                gaps.update(prefill_gaps(plain, prefix, rows, a, b))
        self.view.reset()  # neither cache is kept between flips
        self.exact.reset()
        return {"exact_margin": la - lb, "exact_logits": [la, lb], "exact_dtype": self.exact_dtype,
                "gaps": gaps, "replay_mismatches": differ}

    def judge(self, entry: dict, prompt_ids: Sequence[int], record) -> dict:
        """A first flip's divergence entry (``divergence.classify``) of the method turn ``record`` (its tokens
        and verify shapes) with the exact rule's verdict."""
        shapes = {"tree_sizes": record.tree_sizes, "accept_lengths": record.accept_lengths,
                  "chain_calls": record.chain_calls}
        found = self.rescore(prompt_ids, record.new_tokens, entry["position"], entry["method_token"],
                             entry["vanilla_token"], shapes)
        out = divergence.exact_verdict(entry, found["exact_margin"], found["exact_logits"], found["gaps"],
                                       self.target.dtype, found["exact_dtype"])
        out["replay_mismatches"] = found["replay_mismatches"]
        return out
