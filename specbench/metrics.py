"""Metrics: pure functions over GenerationRecords (docs/methods.md#metrics).

Records are matched across methods by ``(bench, prompt_id, turn)``.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from specbench.records import DECODE_PHASES, GenerationRecord

Key = tuple[str, str, int]


def key(record: GenerationRecord) -> Key:
    return (record.bench, record.prompt_id, record.turn)


def tau(records: Iterable[GenerationRecord]) -> float:
    """Mean accepted length: committed tokens (accepted + bonus) per verify call, pooled."""
    records = list(records)
    calls = sum(r.n_verify for r in records)
    return sum(r.committed for r in records) / calls if calls else float("nan")


def tau_macro(records: Iterable[GenerationRecord]) -> float:
    """Mean over records of each record's own tau (DDTree's per-response averaging)."""
    per = [r.committed / r.n_verify for r in records if r.n_verify]
    return sum(per) / len(per) if per else float("nan")


def tokens_per_second(records: Iterable[GenerationRecord], decode_only: bool = False) -> float:
    """New tokens (cut at EOS and max_new_tokens) per second, pooled over records.

    Decode-only excludes prefill and its first token, which prefill produced."""
    records = list(records)
    if decode_only:
        tokens = sum(max(r.num_new - 1, 0) for r in records)
        seconds = sum(r.decode_time for r in records)
    else:
        tokens = sum(r.num_new for r in records)
        seconds = sum(r.total_time for r in records)
    return tokens / seconds if seconds > 0 else float("nan")


def matched(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]):
    """Pairs (method record, baseline record) on the same prompt turn."""
    base = {key(r): r for r in baseline}
    return [(r, base[key(r)]) for r in method if key(r) in base]


def speedup(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord], decode_only: bool = False) -> float:
    """Throughput ratio over the prompt turns both sides ran."""
    pairs = matched(method, baseline)
    if not pairs:
        return float("nan")
    ours = tokens_per_second([m for m, _ in pairs], decode_only)
    theirs = tokens_per_second([b for _, b in pairs], decode_only)
    return ours / theirs


def draft_share(records: Iterable[GenerationRecord]) -> float:
    """T_D: drafter time / decode-iteration time (draft + verify + commit), decode phase only."""
    records = list(records)
    decode = sum(r.decode_time for r in records)
    return sum(r.times.get("draft", 0.0) for r in records) / decode if decode > 0 else float("nan")


# The engine's phases in the order tables and figures show them (those a record has). Any other phase
# a record times is a drafter's own part of ``draft`` (tree building, online updates, ...), named by it.
ENGINE_PHASES = ("prefill", "draft", "compile", "verify", "commit")


def phase_names(records: Iterable[GenerationRecord]) -> list[str]:
    """Every phase the records time: the engine's in ENGINE_PHASES order, then the others in order of
    first appearance."""
    seen = dict.fromkeys(p for r in records for p in r.times)
    return [p for p in ENGINE_PHASES if p in seen] + [p for p in seen if p not in ENGINE_PHASES]


def draft_subphases(records: Iterable[GenerationRecord]) -> list[str]:
    """The phases drafters time inside ``draft``: every phase that is not the engine's."""
    engine = {*ENGINE_PHASES, *DECODE_PHASES}
    return [p for p in phase_names(records) if p not in engine]


def phase_breakdown(records: Iterable[GenerationRecord]) -> dict[str, float]:
    """Seconds per phase, summed. ``draft_fwd`` = draft minus the drafter's own sub-phases."""
    records = list(records)
    total: Counter = Counter()
    for r in records:
        total.update(r.times)
    draft_fwd = total["draft"]
    for phase in draft_subphases(records):
        draft_fwd -= total[phase]
    total["draft_fwd"] = draft_fwd
    return dict(total)


def acceptance_rates(records: Iterable[GenerationRecord]) -> list[float]:
    """alpha_k for k = 1..: P(depth k accepted | depth k-1 accepted and it had a child)."""
    attempts: list[int] = []
    accepts: list[int] = []
    for r in records:
        for k, (a, c) in enumerate(zip(r.depth_attempts, r.depth_accepts)):
            if k >= len(attempts):
                attempts.append(0)
                accepts.append(0)
            attempts[k] += a
            accepts[k] += c
    return [c / a if a else float("nan") for a, c in zip(attempts, accepts)]


def accept_length_histogram(records: Iterable[GenerationRecord]) -> dict[int, int]:
    """Committed tokens per verify call (accepted + bonus) -> number of calls."""
    hist: Counter = Counter()
    for r in records:
        hist.update(a + 1 for a in r.accept_lengths)
    return dict(sorted(hist.items()))


def drafter_forwards_per_call(records: Iterable[GenerationRecord]) -> float:
    records = list(records)
    calls = sum(r.n_verify for r in records)
    return sum(r.forwards.get("drafter", 0) for r in records) / calls if calls else float("nan")


def greedy_match_rate(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]) -> float:
    """Share of matched prompt turns whose tokens equal the baseline's exactly."""
    pairs = matched(method, baseline)
    return sum(m.new_tokens == b.new_tokens for m, b in pairs) / len(pairs) if pairs else float("nan")


def token_match_rate(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]) -> float:
    """Share of baseline tokens reproduced before the first divergence (softer than the above)."""
    pairs = matched(method, baseline)
    same = total = 0
    for m, b in pairs:
        n = 0
        while n < min(len(m.new_tokens), len(b.new_tokens)) and m.new_tokens[n] == b.new_tokens[n]:
            n += 1
        same += n
        total += len(b.new_tokens)
    return same / total if total else float("nan")


def harness_overhead(records: Iterable[GenerationRecord]) -> float:
    """Share of decode time that is not a model forward (ours: walk, masks, cache surgery, python)."""
    records = list(records)
    decode = sum(r.decode_time for r in records)
    forwards = sum(sum(r.forward_times.values()) for r in records)  # decode-phase forwards only
    return max(decode - forwards, 0.0) / decode if decode > 0 else float("nan")


# ---- the papers' own metrics (where they differ from ours) ---------------------------------------

def mean_time_per_token(records: Iterable[GenerationRecord], decode_only: bool = True) -> float:
    """Mean over records of each record's seconds per output token (DFlash/DDTree average per response).

    Decode-only leaves out prefill and its token, as DDTree's decode timing does."""
    per = []
    for r in records:
        tokens = r.num_new - 1 if decode_only else r.num_new
        seconds = r.decode_time if decode_only else r.total_time
        if tokens > 0 and seconds > 0:
            per.append(seconds / tokens)
    return sum(per) / len(per) if per else float("nan")


def tpot_speedup(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord],
                 decode_only: bool = True) -> float:
    """Baseline mean time per token over the method's, on the prompt turns both ran."""
    pairs = matched(method, baseline)
    if not pairs:
        return float("nan")
    return mean_time_per_token([b for _, b in pairs], decode_only) / mean_time_per_token([m for m, _ in pairs], decode_only)


def faster_baseline_tpot_speedup(method: Sequence[GenerationRecord],
                                 baselines: dict[str, Sequence[GenerationRecord]]) -> tuple[float, str]:
    """``tpot_speedup`` (decode-only mean time per token) against the *faster* vanilla baseline among the
    attention implementations run (e.g. SDPA and flash-attention-2, for a paper that reports the faster).
    ``baselines`` maps the attention implementation to that baseline's records. Returns (speedup, the
    implementation used)."""
    best, used = float("nan"), ""
    for attn, base in sorted(baselines.items()):
        pairs = matched(method, base)
        if not pairs:
            continue
        tpot = mean_time_per_token([b for _, b in pairs])
        if not used or tpot < best:
            best, used = tpot, attn
    if not used:
        return float("nan"), ""
    pairs = matched(method, baselines[used])
    return best / mean_time_per_token([m for m, _ in pairs]), used


def question_speeds(records: Iterable[GenerationRecord]) -> dict[tuple[str, str], float]:
    """Tokens/s per question, its turns summed (Spec-Bench speed.py: sum(new_tokens) / sum(wall_time))."""
    tokens: Counter = Counter()
    seconds: Counter = Counter()
    for r in records:
        tokens[(r.bench, r.prompt_id)] += r.num_new
        seconds[(r.bench, r.prompt_id)] += r.total_time
    return {q: tokens[q] / seconds[q] for q in tokens if seconds[q] > 0}


def spec_bench_speedup(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord]) -> float:
    """Spec-Bench's speedup: mean over questions of the method's tokens/s over the same mean for the
    baseline (a ratio of per-question means, not of pooled throughputs), on the questions both ran."""
    ours, theirs = question_speeds(method), question_speeds(baseline)
    common = sorted(set(ours) & set(theirs))
    if not common:
        return float("nan")
    return (sum(ours[q] for q in common) / len(common)) / (sum(theirs[q] for q in common) / len(common))


# ---- batched records (--batch-size > 1: GenerationRecord.batch) ---------------------------------------
def batch_throughput(records: Iterable[GenerationRecord]) -> float:
    """Tokens per second over all requests of batched records (one method's): their new tokens over the
    summed makespans of their batch groups (latest end - earliest start on each group's clock)."""
    spans: dict = {}
    tokens = 0
    for r in records:
        if not r.batch:
            continue
        lo, hi = spans.get(r.batch["group"], (r.batch["start"], r.batch["end"]))
        spans[r.batch["group"]] = (min(lo, r.batch["start"]), max(hi, r.batch["end"]))
        tokens += r.num_new
    seconds = sum(hi - lo for lo, hi in spans.values())
    return tokens / seconds if seconds > 0 else float("nan")


def request_latency(records: Iterable[GenerationRecord]) -> dict[str, float]:
    """Mean, p50 and p90 (linear interpolation) of batched requests' latency, end - start on the batch
    clock: its prefill, every step it shared, and the prefills of requests that joined meanwhile."""
    values = sorted(r.batch["end"] - r.batch["start"] for r in records if r.batch)
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan")}

    def percentile(q: float) -> float:
        at = q * (len(values) - 1)
        low = int(at)
        high = min(low + 1, len(values) - 1)
        return values[low] + (values[high] - values[low]) * (at - low)

    return {"mean": sum(values) / len(values), "p50": percentile(0.5), "p90": percentile(0.9)}
