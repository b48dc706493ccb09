"""Metrics on hand-built records, where every number can be checked by hand."""

import math

import pytest

from specbench import metrics
from specbench.records import GenerationRecord


def rec(method, pid, new, accept, attempts, accepts, times, forwards=None, forward_times=None, bench="b"):
    return GenerationRecord(method=method, new_tokens=new, prompt_tokens=5, stop_reason="length", times=times,
                            n_verify=len(accept), accept_lengths=accept, tree_sizes=[4] * len(accept),
                            depth_attempts=attempts, depth_accepts=accepts, forwards=forwards or {},
                            forward_times=forward_times or {}, bench=bench, prompt_id=pid)


BASE = [
    rec("vanilla", "p1", [1, 2, 3, 4, 5], [0, 0, 0, 0], [], [], {"prefill": 1.0, "draft": 0.0, "verify": 4.0, "commit": 0.0}),
    rec("vanilla", "p2", [7, 8, 9], [0, 0], [], [], {"prefill": 1.0, "draft": 0.0, "verify": 2.0, "commit": 0.0}),
]
# Chains of 4. p1: 3 calls committing 3+1+2 = 6 (accepted 2, 0, 1); p2: 1 call committing 3.
METHOD = [
    rec("sps", "p1", [1, 2, 3, 4, 5], [2, 0, 1], [3, 2, 1], [2, 1, 0], {"prefill": 1.0, "draft": 1.0, "verify": 1.5, "commit": 0.5},
        {"target": 3, "drafter": 9}, {"target": 1.2, "drafter": 0.8}),
    rec("sps", "p2", [7, 8, 0], [2], [1, 1, 1], [1, 1, 0], {"prefill": 1.0, "draft": 0.5, "verify": 0.5, "commit": 0.0},
        {"target": 1, "drafter": 3}, {"target": 0.4, "drafter": 0.4}),
]


def test_tau_pooled_and_macro():
    assert metrics.tau(METHOD) == pytest.approx((6 + 3) / 4)
    assert metrics.tau_macro(METHOD) == pytest.approx((6 / 3 + 3 / 1) / 2)
    assert metrics.tau(BASE) == 1.0


def test_throughput_and_speedup():
    assert metrics.tokens_per_second(BASE) == pytest.approx(8 / 8.0)
    assert metrics.tokens_per_second(METHOD) == pytest.approx(8 / 6.0)
    assert metrics.speedup(METHOD, BASE) == pytest.approx((8 / 6.0) / (8 / 8.0))
    # decode-only drops prefill and the token it produced
    assert metrics.speedup(METHOD, BASE, decode_only=True) == pytest.approx((6 / 4.0) / (6 / 6.0))


def test_draft_share_and_breakdown():
    assert metrics.draft_share(METHOD) == pytest.approx(1.5 / 4.0)
    assert metrics.draft_share(BASE) == 0.0
    assert metrics.phase_breakdown(METHOD)["draft_fwd"] == pytest.approx(1.5)


def test_acceptance_rates_and_histogram():
    assert metrics.acceptance_rates(METHOD) == pytest.approx([3 / 4, 2 / 3, 0.0])
    assert metrics.accept_length_histogram(METHOD) == {1: 1, 2: 1, 3: 2}
    assert metrics.drafter_forwards_per_call(METHOD) == pytest.approx(12 / 4)


def test_match_rates_and_overhead():
    assert metrics.greedy_match_rate(METHOD, BASE) == 0.5
    assert metrics.token_match_rate(METHOD, BASE) == pytest.approx((5 + 2) / 8)
    assert metrics.harness_overhead(METHOD) == pytest.approx((4.0 - 2.8) / 4.0)


def test_unmatched_prompts_give_nan():
    other = [rec("sps", "p9", [1], [0], [], [], {"prefill": 1.0, "verify": 1.0})]
    assert math.isnan(metrics.speedup(other, BASE))


def test_tau_counts_only_the_tokens_a_turn_keeps():
    """A long draft accepted whole in the last verify (vanilla's own tokens, so all of them are accepted) counts
    only the tokens within --max-new-tokens: τ × verify calls = the tokens the verifies committed to the text,
    through the one-request loop and the batched loop alike."""
    from collections import deque

    from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch
    from specbench.engine.forced import OracleChain
    from specbench.engine.loop import GenerationConfig, generate
    from specbench.engine.vanilla import VanillaDrafter
    from tiny import tiny_target

    target, prompt = tiny_target(0), [1, 2, 3, 4, 5]
    vanilla = generate(target, VanillaDrafter(), prompt, GenerationConfig(16))
    for new in (2, 4):
        oracle = OracleChain(vanilla.new_tokens, [10])  # one verify of 10 drafted tokens, all accepted
        oracle.setup(target)
        one = generate(target, oracle, prompt, GenerationConfig(new))
        oracle = OracleChain(vanilla.new_tokens, [10])
        oracle.setup(target)
        (_, batched), = generate_batch(target, oracle, deque([BatchRequest(0, prompt, GenerationConfig(new))]),
                                       BatchConfig(1))
        for record in (one, batched):
            assert record.new_tokens == vanilla.new_tokens[:new] and record.n_verify == 1
            assert record.accept_lengths == [new - 2]  # 10 accepted; the prefill's token and new - 1 more kept
            assert metrics.tau([record]) * record.n_verify == record.num_new - 1
