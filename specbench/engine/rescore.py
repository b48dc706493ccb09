"""Re-scoring a greedy flip: what exact arithmetic says at the first position where a method's text left
vanilla's, and how far correct forwards in the run's dtype land from it there (the exact rule of
``specbench/divergence.py``, whose docstring defines the figures).

Every forward here goes through ``Target``'s own prefill, compile and verify, on a view of the run's model
with a cache of its own, so the run's target and its cache are left as they were; the exact forward runs on
an upcast copy of the run's model, made once, at the first flip (``Rescorer.exact``)."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Sequence

import torch

from specbench import divergence
from specbench.engine import kvcache
from specbench.engine.target import Target
from specbench.errors import SpecbenchError
from specbench.engine.tree import DraftTree

VERIFY_ROWS = (1, 2, 4, 8, 16)  # rows of the verifies whose last row is the flip's position
EXACT_DTYPES = {"float32": torch.float32, "float64": torch.float64}  # what the exact forward may run in
_EMPTY = DraftTree.empty()


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


def exact_logits(exact: Target, prefix: Sequence[int], a: int, b: int) -> tuple[float, float]:
    """(l[a], l[b]) of the row after ``prefix``: one plain causal forward of the whole prefix."""
    with _full_float32_matmuls():
        row = exact.prefill(prefix).logits[-1]
    return float(row[a]), float(row[b])


def decode_gap(view: Target, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int,
               b: int) -> tuple[float, int]:
    """Vanilla's own way to ``position``: the prompt's prefill, then one one-row step per committed token.
    Returns (the gap at ``position``, how many of the replay's argmaxes differ from ``tokens[:position]`` and
    vanilla's token ``b``: 0 where the replay reproduces the run)."""
    row = view.prefill(prompt_ids).logits[-1]
    differ = 0
    for token in tokens[:position]:
        differ += int(row.argmax()) != int(token)
        row = view.verify(view.compile_tree(int(token), _EMPTY)).logits[-1]
        view.commit([0])
    return _gap(row, a, b), differ + (int(row.argmax()) != b)


def verify_gaps(view: Target, prefix: Sequence[int], rows: int, a: int, b: int) -> dict[str, float]:
    """The gap at the row after ``prefix`` from verifies of its last ``rows`` tokens, after a prefill of the
    rest: as a chain (the causal kernel) and as a tree (a and b as two sibling leaves under the path's last
    node: the masked kernel)."""
    view.prefill(prefix[:-rows])
    root, path = int(prefix[-rows]), [int(t) for t in prefix[len(prefix) - rows + 1:]]
    chain = DraftTree.chain(path)
    last = len(path) - 1  # the path's last node (-1: the root)
    tree = DraftTree(path + [a, b], list(range(-1, last)) + [last, last])
    out = {}
    for name, draft in (("chain", chain), ("tree", tree)):
        logits = view.verify(view.compile_tree(root, draft)).logits
        out[f"{name}_{rows}"] = _gap(logits[rows - 1], a, b)
        kvcache.truncate(view.cache, view.length)  # drop the verify's rows: the next one starts from the prefill
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

    def rescore(self, prompt_ids: Sequence[int], tokens: Sequence[int], position: int, a: int, b: int) -> dict:
        """The figures of the flip at ``position`` (method token ``a``, vanilla token ``b``) after ``prompt_ids``
        and the committed ``tokens`` before it: exact_margin, exact_logits, exact_dtype, gaps and
        replay_mismatches (``decode_gap``)."""
        prefix = [int(t) for t in prompt_ids] + [int(t) for t in tokens[:position]]
        la, lb = exact_logits(self.exact, prefix, a, b)
        gap, differ = decode_gap(self.view, prompt_ids, tokens, position, a, b)
        gaps = {"decode": gap}
        for rows in VERIFY_ROWS:
            if rows < len(prefix):  # the prefill before the verify needs one token at least
                gaps.update(verify_gaps(self.view, prefix, rows, a, b))
        self.view.reset()  # neither cache is kept between flips
        self.exact.reset()
        return {"exact_margin": la - lb, "exact_logits": [la, lb], "exact_dtype": self.exact_dtype,
                "gaps": gaps, "replay_mismatches": differ}

    def judge(self, entry: dict, prompt_ids: Sequence[int], tokens: Sequence[int]) -> dict:
        """A first flip's divergence entry (``divergence.classify``) with the exact rule's verdict."""
        found = self.rescore(prompt_ids, tokens, entry["position"], entry["method_token"], entry["vanilla_token"])
        out = divergence.exact_verdict(entry, found["exact_margin"], found["exact_logits"], found["gaps"],
                                       self.target.dtype, found["exact_dtype"])
        out["replay_mismatches"] = found["replay_mismatches"]
        return out
