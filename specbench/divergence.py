"""Why a method's greedy text differs from vanilla's: a near-tie the dtype cannot separate, or a bug.

At T = 0 every method must commit vanilla's tokens. In fp32 they do; in bf16 (or fp16) a batched verify
rounds in another order than vanilla's one-row decode step, so where the target's two best tokens are
nearly tied the argmax can flip, and from there the texts part ways. A flip is `near-tie` only when,
at the first differing position i, both sides say the two tokens were within the dtype's rounding of
each other; anything else is `unexplained` (a wrong cache row, a wrong mask, a wrong position...).

What each side keeps (``TopLogits``): per committed token, the K best logits of the target's row that
chose it, taken from the logits the verify (or vanilla's decode) forward already computed, outside the
timed phases and without a forward of its own. At position i the method committed a, vanilla b:

* method margin  m = l_M[a] − l_M[b]  (≥ 0: a won there),
* vanilla margin v = l_V[b] − l_V[a]  (≥ 0: b won there).

The two sides computed the same quantity, the gap l[a] − l[b] of one context, and got −v and +m: the
computations disagree by m + v. How far may two correct forwards disagree? A value stored in a dtype with
unit roundoff u (2^-8 bf16, 2^-11 fp16, 2^-24 fp32: ``torch.finfo(dtype).eps / 2``) is off by up to u
relative to its size. On its way to a logit the residual stream is rounded to the dtype after each of the
two additions of every decoder layer (attention, MLP), and the final norm and the lm_head product are
stored in it too: 2L + 2 roundings for L layers. A batched verify and a one-row step round in different
orders, so their errors are independent and add like a random walk: a logit carries about
√(2L + 2) · u · |l| (``roundings``), and each side's gap

    δ_side = √(2L + 2) · u · (|l[a]| + |l[b]|);

where |l| is floored at the row's scale S, the RMS of the whole logit row at that position. A logit is a dot
product h·w of the final hidden state and a vocabulary row: the rounding carried by h reaches every logit with
a size set by |h|·|w| (what S measures), not by the logit itself, which cancellation can bring near 0. With
|l| alone, a flip between two logits near 0.9 (Natural Questions, SmolLM2-135M in bf16 on a Xeon with AMX) got
δ = 0.11 while the same turn's forwards disagreed by 0.22 on tokens both committed; with the floor at S the
large logits of most rows keep their old δ.

The divergence is a near-tie when

    m + v ≤ δ_method + δ_vanilla,

with each token among the other side's K best (as vLLM's speculative-decoding tests accept a
divergence only where the chosen token is among the other side's top log-probabilities). A token
outside the other side's K best gives only a lower bound on its margin: unexplained.

``noise`` (the largest |l_M[t] − l_V[t]| of the committed token t over the positions before i, where
both sides agree) and ``noise_roundings`` (the same in units of u·|l|) show how far the two forwards
actually disagree on this turn, so δ can be checked against the data: δ allows ``roundings`` per logit
(SmolLM2-135M, L = 30: 7.9; its bf16 verifies on a CPU with AMX disagreed with the one-row step by up to
5.2 on the tokens both committed).

A later turn of a conversation whose earlier turn diverged has another prompt on each side (each
renders its own earlier answers), so its tokens are not compared: it takes the earlier turn's status
(``after_turn``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

TOP_K = 4  # logits kept per committed token (the other side's token must be among them)

IDENTICAL, NEAR_TIE, UNEXPLAINED, UNCHECKED = "identical", "near-tie", "unexplained", "unchecked"
STATUSES = (IDENTICAL, NEAR_TIE, UNEXPLAINED, UNCHECKED)


@dataclass
class TopLogits:
    """Per committed token (new_tokens order): the ``TOP_K`` best token ids and logits of the target row
    that chose it, best first. Kept in memory beside a record (never written to the results file)."""

    ids: list[list[int]]
    values: list[list[float]]
    scales: list[float] = field(default_factory=list)  # RMS of each row's logits (the rounding's scale)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[torch.Tensor, ...]], n: int) -> "TopLogits":
        """From the engine's per-step (values, ids, scales) tensors (``top_rows``), on any device: one copy
        to the host, cut to the record's ``n`` new tokens."""
        if not rows:
            return cls([], [])
        values, ids, scales = (torch.cat(parts).cpu()[:n] for parts in zip(*rows))
        return cls(ids.tolist(), values.float().tolist(), scales.tolist())

    def scale(self, position: int) -> float:
        """The RMS of the logit row at ``position`` (0 when not kept)."""
        return self.scales[position] if position < len(self.scales) else 0.0

    def logit(self, position: int, token: int) -> float | None:
        """The logit of ``token`` at ``position``, or None when it is not among the K best there."""
        ids = self.ids[position]
        return self.values[position][ids.index(token)] if token in ids else None


def top_rows(logits: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, ids) of the k best logits of each row and the row's RMS; stays on the logits' device (no
    host sync)."""
    logits = logits.detach()
    out = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    rms = torch.linalg.vector_norm(logits, dim=-1, dtype=torch.float32) / math.sqrt(logits.shape[-1])
    return out.values, out.indices, rms


def unit_roundoff(dtype: str | torch.dtype) -> float:
    """u of a floating dtype: half its machine epsilon (the largest relative error of one rounding)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"not a floating dtype: {dtype!r}")
    return torch.finfo(dtype).eps / 2


def roundings(layers: int) -> float:
    """The accumulated rounding of one logit in units of u·|l|: 2L + 2 independent roundings (two residual
    additions per layer, the final norm, the lm_head) adding like a random walk."""
    return math.sqrt(2 * max(int(layers), 0) + 2)


def layers_of(model) -> int:
    """The decoder layers of a transformers model (0 when its config does not say)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def tolerance(dtype: str | torch.dtype, a: float, b: float, layers: int, scale: float = 0.0) -> float:
    """δ of one side: the rounding its gap l[a] − l[b] can carry in ``dtype`` after ``layers`` layers, each
    logit's size floored at its row's RMS ``scale``."""
    return roundings(layers) * unit_roundoff(dtype) * (max(abs(a), scale) + max(abs(b), scale))


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where the two token lists differ (one ending early counts), None if equal."""
    for i, (x, y) in enumerate(zip(ours, theirs)):
        if x != y:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _noise(ours: TopLogits, theirs: TopLogits, tokens: Sequence[int], upto: int, u: float) -> tuple[float, float]:
    """(largest |Δ logit|, largest |Δ logit| / (u·|logit|)) of the committed tokens before ``upto``."""
    worst = worst_r = 0.0
    for j in range(min(upto, len(ours.ids), len(theirs.ids))):
        x, y = ours.logit(j, tokens[j]), theirs.logit(j, tokens[j])
        if x is None or y is None:
            continue
        diff = abs(x - y)
        worst = max(worst, diff)
        scale = u * max(abs(x), abs(y))
        worst_r = max(worst_r, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst, worst_r


def _margin(top: TopLogits, i: int, winner: int, loser: int) -> tuple[float, bool, float, float]:
    """(margin of winner over loser at i, exact?, winner's logit, loser's logit or the K-th best): a loser
    outside the K best gives a lower bound."""
    won = top.logit(i, winner)
    lost = top.logit(i, loser)
    if won is None:  # cannot happen for a greedy commit (the winner is the argmax); say so rather than guess
        return math.nan, False, math.nan, math.nan
    exact = lost is not None
    lost = lost if exact else top.values[i][-1]
    return won - lost, exact, won, lost


def classify(method_tokens: Sequence[int], vanilla_tokens: Sequence[int], method_top: TopLogits | None,
             vanilla_top: TopLogits | None, dtype: str | torch.dtype, layers: int) -> dict:
    """The divergence record of one method turn against vanilla's same turn (same prompt, T = 0) of a
    target with ``layers`` decoder layers."""
    i = first_difference(method_tokens, vanilla_tokens)
    u = unit_roundoff(dtype)
    if method_top is None or vanilla_top is None:
        return {"status": IDENTICAL} if i is None else {
            "status": UNCHECKED, "position": i, "why": "one side's logits were not kept (a resumed run)"}
    noise, noise_r = _noise(method_top, vanilla_top, method_tokens, len(method_tokens) if i is None else i, u)
    out = {"noise": noise, "noise_roundings": noise_r}
    if i is None:
        return {"status": IDENTICAL, **out}
    if i >= min(len(method_tokens), len(vanilla_tokens)) or i >= min(len(method_top.ids), len(vanilla_top.ids)):
        return {"status": UNEXPLAINED, "position": i, "why": "one side stopped early", **out}
    a, b = int(method_tokens[i]), int(vanilla_tokens[i])
    m, m_exact, ma, mb = _margin(method_top, i, a, b)
    v, v_exact, vb, va = _margin(vanilla_top, i, b, a)
    ms, vs = method_top.scale(i), vanilla_top.scale(i)
    delta = (tolerance(dtype, ma, mb, layers, ms) + tolerance(dtype, va, vb, layers, vs)
             if m_exact and v_exact else math.nan)
    near = m_exact and v_exact and m + v <= delta
    return {"status": NEAR_TIE if near else UNEXPLAINED, "position": i, "method_token": a, "vanilla_token": b,
            "method_margin": m, "vanilla_margin": v, "method_margin_exact": m_exact, "vanilla_margin_exact": v_exact,
            "method_scale": ms, "vanilla_scale": vs, "tolerance": delta, "roundings": roundings(layers), **out}


def inherited(earlier: dict, turn: int) -> dict:
    """A later turn of a conversation that diverged at ``turn``: it carries that turn's status."""
    return {"status": earlier.get("status", UNCHECKED), "after_turn": turn}


def counts(divergences: Iterable[dict | None]) -> dict[str, int]:
    """Turns per status (records without a divergence entry are not counted)."""
    out = dict.fromkeys(STATUSES, 0)
    for d in divergences:
        if d:
            out[d.get("status", UNCHECKED)] = out.get(d.get("status", UNCHECKED), 0) + 1
    return out


def summary(divergences: Iterable[dict | None]) -> str:
    """'identical/near-tie/unexplained' counts, with unchecked ones named when there are any."""
    c = counts(divergences)
    text = f"{c[IDENTICAL]}/{c[NEAR_TIE]}/{c[UNEXPLAINED]}"
    return text + (f" (+{c[UNCHECKED]} unchecked)" if c[UNCHECKED] else "")
