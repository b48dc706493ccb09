"""A method's greedy text against vanilla's: identical in fp32, near-ties in bf16, and a broken verify
(wrong cache rows after compaction) caught as `unexplained`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from drafters import tree_against_vanilla
from specbench import divergence
from specbench.engine import kvcache
from specbench.divergence import NEAR_TIE, UNEXPLAINED, TopLogits, classify
from specbench.engine.target import Target
from tiny import tiny_llama

VOCAB = 512


def _judged_pairs(target: Target, n: int) -> list[dict]:
    """The bound's verdict on each of n random-tree turns against vanilla's."""
    return [classify(ours.new_tokens, base.new_tokens, ours.top_logits, base.top_logits, target.dtype,
                     divergence.layers_of(target.model)) for _, ours, base in tree_against_vanilla(target, n)]


def test_margins_decide_near_tie_or_unexplained():
    u = divergence.unit_roundoff("bfloat16")  # with 30 layers a logit near 3 may carry √62 · u · 3 ≈ 0.09
    base = TopLogits([[5, 7, 1, 2], [9, 3, 1, 2]], [[10.0, 9.0, 1.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    tie = TopLogits([[5, 7, 1, 2], [3, 9, 1, 2]], [[10.0, 9.0, 1.0, 0.0], [3.0 + 4 * u, 3.0, 2.0, 1.0]])
    far = TopLogits([[5, 7, 1, 2], [3, 9, 1, 2]], [[10.0, 9.0, 1.0, 0.0], [5.0, 3.0, 2.0, 1.0]])
    out = classify([5, 3], [5, 9], tie, base, "bfloat16", 30)
    # vanilla's margin 1.0 (9 over 3 at position 1) is far beyond bf16 rounding of logits near 3-4
    assert out["status"] == UNEXPLAINED and out["position"] == 1 and out["vanilla_margin"] == pytest.approx(1.0)
    close = TopLogits([[5, 7, 1, 2], [9, 3, 1, 2]], [[10.0, 9.0, 1.0, 0.0], [3.0 + 2 * u, 3.0, 2.0, 1.0]])
    near = classify([5, 3], [5, 9], tie, close, "bfloat16", 30)
    assert near["status"] == NEAR_TIE and near["method_margin"] + near["vanilla_margin"] <= near["tolerance"]
    assert classify([5, 3], [5, 9], far, close, "bfloat16", 30)["status"] == UNEXPLAINED
    # the same gaps in fp32 are far beyond its rounding
    assert classify([5, 3], [5, 9], tie, close, "float32", 30)["status"] == UNEXPLAINED
    # the other side's token outside its K best: only a lower bound, never a near-tie
    outside = TopLogits([[5, 7, 1, 2], [3, 8, 1, 2]], [[10.0, 9.0, 1.0, 0.0], [3.0, 3.0, 2.0, 1.0]])
    assert classify([5, 3], [5, 9], outside, close, "bfloat16", 30)["method_margin_exact"] is False
    assert classify([5, 3], [5, 9], outside, close, "bfloat16", 30)["status"] == UNEXPLAINED
    assert classify([5, 9], [5, 9], base, base, "bfloat16", 30) == {"status": "identical", "noise": 0.0,
                                                                "noise_roundings": 0.0}
    assert classify([5, 3], [5, 9], None, base, "bfloat16", 30)["status"] == "unchecked"


def test_delta_follows_the_dtype():
    assert divergence.unit_roundoff(torch.bfloat16) == 2**-8
    assert divergence.unit_roundoff("float16") == 2**-11
    assert divergence.unit_roundoff("float32") == 2**-24
    assert divergence.roundings(30) == pytest.approx(62 ** 0.5) and divergence.roundings(0) == pytest.approx(2 ** 0.5)
    assert divergence.tolerance("bfloat16", 20.0, -20.0, 30) == pytest.approx(62 ** 0.5 * 40 * 2**-8)
    assert divergence.layers_of(tiny_llama(0)) == 2


def test_fp32_turns_are_identical():
    target = Target(tiny_llama(0, vocab=VOCAB, init=0.05), None, "tiny")
    out = _judged_pairs(target, 6)
    assert all(d["status"] == "identical" for d in out)
    assert max(d["noise_roundings"] for d in out) < 64  # fp32: a batched verify stays within a few roundings


def test_bf16_run_classifies_its_divergences():
    target = Target(tiny_llama(0, vocab=VOCAB, init=0.05).to(torch.bfloat16), None, "tiny-bf16")
    out = _judged_pairs(target, 12)
    counts = divergence.counts(out)
    assert counts["identical"] + counts["near-tie"] + counts["unexplained"] == 12
    assert counts["near-tie"] >= 1  # this model has near-ties that flip under batched bf16 verifies
    assert counts["unexplained"] == 0  # and nothing else: the verify is correct
    for d in out:
        if d["status"] == NEAR_TIE:
            assert d["method_margin_exact"] and d["vanilla_margin_exact"] and math.isfinite(d["tolerance"])


def test_a_wrong_cache_row_is_unexplained(monkeypatch):
    """Break the KV compaction after a verify that accepted drafts (an off-by-one: the root's row is kept
    twice and the last accepted row is lost): the method's later logits are wrong, and its divergence is
    no near-tie. Vanilla commits by a plain crop and never gets here."""
    real = kvcache.compact

    def wrong_rows(cache, start, rows, new_len):
        if new_len - start > 1:
            rows = torch.arange(new_len - start) if rows is None else rows
            rows = torch.cat([rows[:1], rows[:-1]])
        real(cache, start, rows, new_len)

    monkeypatch.setattr(kvcache, "compact", wrong_rows)
    target = Target(tiny_llama(0, vocab=VOCAB, init=0.05), None, "tiny")
    out = _judged_pairs(target, 6)
    diverged = [d for d in out if d["status"] != "identical"]
    assert diverged and all(d["status"] == UNEXPLAINED for d in diverged)


def test_run_records_and_summarises_divergence(models, tmp_path, capsys):
    from test_cli import base_args, cli

    out = tmp_path / "r.jsonl"
    code, _, err = cli(base_args(models, out, "--limit", "3"), capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    records = [o for o in lines if o["type"] == "record"]
    sps = [r for r in records if r["method"] == "sps"]
    assert len(sps) == 3 and all(r["divergence"]["status"] == "identical" for r in sps)  # fp32: lossless
    assert all(r["divergence"] is None for r in records if r["method"] == "vanilla")
    assert "top_logits" not in records[0]  # the logits stay in memory


def test_small_logits_are_floored_at_their_rows_scale():
    """A flip between two logits near 0.9 in a row whose logits have RMS 8: each logit carries the rounding of
    |h|·|w| (the row's scale), not of its own small size (found on Natural Questions in bf16 on a Xeon)."""
    vanilla = TopLogits([[5, 7, 1, 2]], [[0.95, 0.845, 0.0, -1.0]], [8.0])
    method = TopLogits([[7, 5, 1, 2]], [[0.87, 0.845, 0.0, -1.0]], [8.0])
    out = classify([7], [5], method, vanilla, "bfloat16", 30)
    assert out["status"] == NEAR_TIE and out["method_scale"] == out["vanilla_scale"] == 8.0
    assert out["tolerance"] == pytest.approx(62 ** 0.5 * 2**-8 * 32)
    unscaled = classify([7], [5], TopLogits(method.ids, method.values), TopLogits(vanilla.ids, vanilla.values),
                        "bfloat16", 30)
    assert unscaled["status"] == UNEXPLAINED  # the logits' own size allows only 0.1
    # a margin of whole logits stays unexplained whatever the scale
    far = TopLogits([[7, 5, 1, 2]], [[4.0, 0.95, 0.0, -1.0]], [8.0])
    assert classify([7], [5], far, vanilla, "bfloat16", 30)["status"] == UNEXPLAINED
    # the scale never shrinks δ below the logits' own size
    assert divergence.tolerance("bfloat16", 20.0, -20.0, 30, scale=8.0) == pytest.approx(62 ** 0.5 * 40 * 2**-8)


def test_top_rows_keep_each_rows_rms():
    logits = torch.tensor([[3.0, -4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    values, ids, scales = divergence.top_rows(logits, k=2)
    assert ids[0].tolist() == [0, 2] and scales.tolist() == pytest.approx([5.0 / 5 ** 0.5, 1.0])
    top = TopLogits.from_rows([(values, ids, scales)], n=2)
    assert top.scale(0) == pytest.approx(5.0 / 5 ** 0.5) and top.scale(7) == 0.0
