"""How closely a method's verify rows agree with vanilla's one-row steps at every committed position: the
teacher-forced check (`specbench run --check forced`, T = 0).

In a forced pass (``engine/forced.py``) the method drafts and the target verifies as usual, but the committed
tokens are vanilla's (``verify.forced_walk``), so every verify row that chose a committed token has a twin:
vanilla's sequential step at the same position over the same prefix. Per position (the prefill's row is one
forward on both sides and is left out) the two logit rows are compared:

* max |Δlogit|: the largest difference over the whole vocabulary;
* top-1: whether the two rows' argmax agree;
* top-2 margin: the gap between vanilla's two best tokens, l[b1] − l[b2], as each side computes it; its
  |Δmargin|, and whether the order of the two tokens agrees (same sign).

Unlike the divergence check (``divergence.py``), which reads only the positions before the texts part, this
reads every position of the turn. A turn's figures keep the quantiles of the per-position max and the values
themselves (``deltas``, 4 significant digits), so a report pools turns exactly. ``aa`` holds the same figures
for an oracle chain that proposes vanilla's own tokens at the method's row counts (all accepted): the batched
forward's own disagreement with the one-row step, with no tree logic. In fp32 every committed row must equal
vanilla's within ``FP32_BOUND``; in bf16 there is no absolute bound, and the method's figures must match the
A/A ones."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

# Largest |Δlogit| the engine allows an fp32 verify row against vanilla's one-row step. On SmolLM2-135M in fp32
# (3 HumanEval prompts x 64 tokens, 189 positions per method, shipped drafters) the largest seen was 7.7e-5
# (DDTree, 33 rows; SpS 3.7e-5, PLD 3.7e-5, EAGLE-3 6.7e-5, SpecBlock 7.0e-5, Medusa 7.0e-5) and the A/A
# chains' 7.2e-5: the batched forward's own rounding, tree or not. The bound leaves 6.5x room for other prompts
# and row counts; the injected bugs of the tests move rows by 0.02 logit and more even on tiny random models.
FP32_BOUND = 5e-4
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
FIGURES = ("max", *QUANTILES, "top1", "margin_max", "margin_order")  # None where no position was checked


def compare_rows(method: torch.Tensor, vanilla: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position of two [n, V] logit stacks: max |Δlogit| (``delta``), argmax agreement (``top1``), the
    |Δ| of the margin between vanilla's two best tokens (``margin``) and whether their order agrees (``order``)."""
    method, vanilla = method.float(), vanilla.float()
    best = vanilla.topk(2, dim=-1).indices
    v_pair, m_pair = vanilla.gather(-1, best), method.gather(-1, best)
    v_margin, m_margin = v_pair[:, 0] - v_pair[:, 1], m_pair[:, 0] - m_pair[:, 1]
    return {"delta": (method - vanilla).abs().amax(-1), "top1": method.argmax(-1) == vanilla.argmax(-1),
            "margin": (m_margin - v_margin).abs(), "order": torch.sign(m_margin) == torch.sign(v_margin)}


def tokens_differ(ours: Sequence[int], theirs: Sequence[int]) -> int:
    """Positions where the two token lists differ (a position only one side has counts)."""
    return sum(a != b for a, b in zip(ours, theirs)) + abs(len(ours) - len(theirs))


def row_counts(tree_sizes: Sequence[int]) -> dict[str, int]:
    """Verify calls per row count (drafted nodes + the root), keys as text for JSON."""
    return {str(rows): n for rows, n in sorted(Counter(size + 1 for size in tree_sizes).items())}


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    return {name: float(torch.quantile(values, q)) for name, q in QUANTILES.items()}


def _figures(delta: torch.Tensor, top1: torch.Tensor, margin: torch.Tensor, order: torch.Tensor) -> dict:
    if delta.numel() == 0:
        return dict.fromkeys(FIGURES)
    return {"max": float(delta.max()), **_quantiles(delta), "top1": float(top1.float().mean()),
            "margin_max": float(margin.max()), "margin_order": float(order.float().mean())}


def _significant(x: float) -> float:
    return float(f"{x:.4g}")


def summarise(method_rows: torch.Tensor, vanilla_rows: torch.Tensor, method_tokens: Sequence[int],
              vanilla_tokens: Sequence[int], tree_sizes: Sequence[int]) -> dict:
    """One side's figures for a turn: its rows (row j chose token j) against vanilla's, from position 1 on."""
    n = min(len(method_rows), len(vanilla_rows))
    per = compare_rows(method_rows[1:n], vanilla_rows[1:n])
    return {"positions": max(n - 1, 0), "tokens_differ": tokens_differ(method_tokens, vanilla_tokens),
            **_figures(per["delta"], per["top1"], per["margin"], per["order"]), "rows": row_counts(tree_sizes),
            "deltas": [_significant(x) for x in per["delta"].tolist()]}


def within(side: dict, bound: float) -> bool:
    """Whether one side of a turn passes an absolute bound: vanilla's tokens committed, every row within it."""
    return side["tokens_differ"] == 0 and (side["max"] is None or side["max"] <= bound)


def pooled(sides: Iterable[dict]) -> dict:
    """Several turns' figures of one side as one: quantiles and max over every position's max |Δlogit|,
    fractions weighted by positions, and the turns that committed a token other than vanilla's."""
    sides = [s for s in sides if s]
    positions = sum(s["positions"] for s in sides)
    deltas = torch.tensor([d for s in sides for d in s.get("deltas", ())], dtype=torch.float64)
    out = {"turns": len(sides), "positions": positions, "turns_off_tokens": sum(s["tokens_differ"] > 0 for s in sides)}
    if deltas.numel() == 0 or positions == 0:
        return {**out, **dict.fromkeys(FIGURES)}

    def weighted(key: str) -> float:
        return sum(s[key] * s["positions"] for s in sides if s[key] is not None) / positions

    return {**out, "max": max(s["max"] for s in sides if s["max"] is not None), **_quantiles(deltas),
            "top1": weighted("top1"),
            "margin_max": max(s["margin_max"] for s in sides if s["margin_max"] is not None),
            "margin_order": weighted("margin_order")}
