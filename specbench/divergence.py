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
(``after_turn``).

**The exact rule** (``exact_verdict``). The bound above is a worst case on the logits' size: at the reference
set's bf16 flips it granted 1.2–4.5 logits while the gaps seen there were 0.03–0.5, so a bug that moved a gap by
a logit or two would pass as a near-tie. The exact rule asks instead what exact arithmetic says at the flip. The
shared prefix (the prompt and the tokens both sides committed before i) is re-scored
(``specbench/engine/rescore.py``):

* the exact gap e = l[a] − l[b]: one plain causal forward of the prefix in float32 with the weights the run used
  (its dtype's values, upcast), so that e differs from the run's forwards by their arithmetic rounding only
  (float32's own is about 1e-6 of a logit, four orders below bf16's; float64 would change nothing measurable and
  transformers' Llama keeps its norms and rotary tables in float32 anyway);
* the gaps g of correct forwards of the same prefix in the run's dtype at that position, the model's forward
  called plainly (positions, tree masks and cache truncation built by the re-scorer, not by the engine's verify
  path, so that a bug there cannot make its own reference): vanilla's way (``decode``: the prompt's prefill, then
  one one-row step per token, the very forwards vanilla ran, so on the machine that ran it g is vanilla's
  recorded gap); the method's own verify shapes replayed (``method``: per verify of its record as many rows,
  its committed tokens as the path, its tree sizes and acceptances from the record; the tree's topology is not
  recorded, so the path comes first and the rest hang under the root); caches built as a steady method builds
  them (``chain_r``, ``tree_r``: the committed tokens through verifies of r rows each, r = 2, 4, 8, 16, the last
  ending at i); and verifies of the last r rows after one prefill of the rest (``prefill_chain_r``,
  ``prefill_tree_r``, r = 1, 2, 4, 8, 16). Chains run the causal kernel, trees (a and b as two leaves under the
  path's last row) the masked one. A method's logits at i depend on how its cache was built, not only on its
  last verify: on SmolLM2-135M in bf16 the prefilled caches alone missed a flip that the stepped ones reproduce;
  a record of a batched run (``batch``, size B > 1: its requests verified in one forward over a right-padded
  cache, and vanilla's turn decoded in the same batches) adds the same in batched shapes, for B = its batch size
  and its mean number of active requests rounded (``batch_sizes``): the method's verifies (``batch{B}_method``)
  and verifies of r rows each (``batch{B}_chain_r``, r = 1, 2, 4, r = 1 being vanilla's batched decode;
  ``batch{B}_tree_r``, r > 1), every forward shared with B − 1 neighbours (copies of the prompt a few tokens
  longer and shorter, verifying the same tokens), the right-padded cache, masks and positions built by the
  re-scorer, not by the engine's batch path. A batched forward's matrix products have B·Q rows and its
  attention the padded width, so it rounds otherwise than batch 1 (on tiny random models on a CPU, the 13 flips
  of bf16 runs at B = 2 and 4 were near-ties with batch 1's gaps alone, and stay so);
* the position's noise N = max(max_g |g − e|, u·(|l[a]| + |l[b]|)): how far correct forwards in the run's dtype
  land from e at this very position, never less than one rounding of each of the two logits into the dtype (a
  stored logit is off by up to u of its size whatever computed it, so two logits within that of each other may
  tie, margin 0, as recorded flips show; a handful of forwards could otherwise all round the same way).

The flip is a near-tie when both sides' recorded gaps lie within N of e and both margins are exact:
|m − e| ≤ N and |−v − e| ≤ N (``method_offset`` = m − e, ``vanilla_offset`` = −v − e). Each side then did what a
correct forward in this dtype does at this position, and |e| ≤ N follows (the two gaps have opposite signs): the
two tokens are within the dtype's measured noise of each other. Anything else is unexplained: a side whose gap
lands farther from e than every correct forward did computed another quantity (a wrong position, a stale cache
row, a perturbed logit row), whichever token exact arithmetic prefers. The noise is measured at the position,
not bounded from the logits' size, and the method's own gap is tested, not only the two margins' sum (a
perturbation at a true near-tie leaves |e| small but moves m). N is the largest of a handful of samples, so a
correct method whose forward strays one bf16 step further than all of them is called unexplained: on tiny
random models 1 of 36 correct flips was (its per-flip figures show it), none of the five flips of
SmolLM2-135M in a bf16 HumanEval file of the reference set.

A bf16 or fp16 run at T = 0 re-scores its new flips this way (an fp32 copy of the target made at the first flip,
once per run, outside the timed phases); ``specbench recheck`` applies it to files already written. A re-scored
entry carries ``rule`` = "exact", the exact rule's verdict in ``status`` and the bound's in ``old_status`` (kept
for one release), ``exact_margin``, ``exact_logits`` [l[a], l[b]], ``exact_dtype``, ``gaps``, ``position_noise``,
``rounding_floor``, ``method_offset``, ``vanilla_offset`` and ``replay_mismatches`` (the decode replay's argmaxes
that differ from the committed tokens: 0 where the prompt was rendered as the run rendered it); ``recheck`` adds
``rescored_on``, the machine whose noise was measured. fp32 runs keep the bound: there every text equals
vanilla's, and any flip exceeds it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

TOP_K = 4  # logits kept per committed token (the other side's token must be among them)

IDENTICAL, NEAR_TIE, UNEXPLAINED, UNCHECKED = "identical", "near-tie", "unexplained", "unchecked"
STATUSES = (IDENTICAL, NEAR_TIE, UNEXPLAINED, UNCHECKED)
EXACT = "exact"  # ``rule`` of an entry whose status the exact rule set (absent: the bound's)
FLIPS = (NEAR_TIE, UNEXPLAINED)


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
        name = dtype.replace("torch.", "")
        dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name), None)
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
    """A later turn of a conversation that diverged at ``turn``: it carries that turn's status (and, where the
    exact rule set it, the rule and the bound's verdict)."""
    out = {"status": earlier.get("status", UNCHECKED), "after_turn": turn}
    out.update({k: earlier[k] for k in ("rule", "old_status") if k in earlier})
    return out


def exact_rule_applies(dtype: str | torch.dtype) -> bool:
    """Whether a run's flips are re-scored (bf16, fp16); fp32 keeps the bound (its texts equal vanilla's)."""
    return unit_roundoff(dtype) > unit_roundoff(torch.float32)


def rescorable(entry: dict | None) -> bool:
    """A first flip whose two tokens and both margins were recorded (an inherited or unchecked turn is not)."""
    return bool(entry) and "method_token" in entry and "method_margin" in entry and "after_turn" not in entry


def rounding_floor(dtype: str | torch.dtype, logit_a: float, logit_b: float) -> float:
    """One rounding of each of two logits into ``dtype``: the least two correct forwards may differ by."""
    return unit_roundoff(dtype) * (abs(logit_a) + abs(logit_b))


def position_noise(exact_margin: float, exact_logits: Sequence[float], gaps: dict[str, float],
                   dtype: str | torch.dtype) -> float:
    """N: the farthest a correct forward's gap in ``dtype`` landed from the exact gap, floored at one rounding
    of each logit (see the module docstring)."""
    return max([rounding_floor(dtype, *exact_logits), *(abs(g - exact_margin) for g in gaps.values())])


def exact_verdict(entry: dict, exact_margin: float, exact_logits: Sequence[float], gaps: dict[str, float],
                  dtype: str | torch.dtype, exact_dtype: str | torch.dtype) -> dict:
    """A first flip's entry (``classify``) judged by the exact rule: ``status`` its verdict, ``old_status`` the
    bound's (kept from an earlier re-scoring), and the figures it rests on (module docstring)."""
    la, lb = (float(x) for x in exact_logits)
    noise = position_noise(exact_margin, (la, lb), gaps, dtype)
    method_offset = entry["method_margin"] - exact_margin
    vanilla_offset = -entry["vanilla_margin"] - exact_margin
    exact_inputs = bool(entry.get("method_margin_exact") and entry.get("vanilla_margin_exact"))
    near = exact_inputs and abs(method_offset) <= noise and abs(vanilla_offset) <= noise
    out = dict(entry)  # a judged entry judged again keeps its keys' order
    out.update(status=NEAR_TIE if near else UNEXPLAINED, old_status=entry.get("old_status", entry["status"]),
               rule=EXACT, exact_margin=float(exact_margin), exact_logits=[la, lb],
               exact_dtype=str(exact_dtype).replace("torch.", ""), gaps=dict(gaps), position_noise=noise,
               rounding_floor=rounding_floor(dtype, la, lb), method_offset=method_offset,
               vanilla_offset=vanilla_offset)
    if near:
        out.pop("why", None)
    elif not exact_inputs:
        out["why"] = "a side's margin is only bounded (the other token is outside its K best)"
    else:
        side, offset = ("method", method_offset) if abs(method_offset) > noise else ("vanilla", vanilla_offset)
        out["why"] = (f"the {side}'s gap is {abs(offset):.3g} from the exact gap {exact_margin:.3g}, beyond the "
                      f"position's noise {noise:.3g}")
    return out


def rule_counts(divergences: Iterable[dict | None]) -> dict[str, int]:
    """Per turn that diverged: the bound's verdicts (``old_*``: ``old_status`` where the exact rule re-judged it),
    the exact rule's (``exact_*``), the turns the two judge differently (``disagree``) and the flips the exact
    rule has not judged (``not_rescored``)."""
    out = dict(old_near_tie=0, old_unexplained=0, exact_near_tie=0, exact_unexplained=0, disagree=0,
               not_rescored=0)
    for d in divergences:
        if not d or d.get("status") not in FLIPS:
            continue
        old = d.get("old_status", d["status"])
        out["old_near_tie" if old == NEAR_TIE else "old_unexplained"] += 1
        if d.get("rule") != EXACT:
            out["not_rescored"] += 1
            continue
        out["exact_near_tie" if d["status"] == NEAR_TIE else "exact_unexplained"] += 1
        out["disagree"] += old != d["status"]
    return out


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
