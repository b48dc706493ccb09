"""Batched decoding (engine/batch_loop.py) with tiny real models: the ragged cache moves each request's
rows where they belong, one batched verify gives every request its batch-1 logits, and at T = 0 in fp32
every request's text equals its batch-1 vanilla text whatever its neighbours (other prompt lengths, a
neighbour stopping at EOS inside an accepted chain, a neighbour accepting nothing), for every method
that may be batched; methods that learn while serving are refused in one line."""

from __future__ import annotations

import re
from collections import deque

import pytest
import torch

from drafters import random_tree
from methods.eagle3.drafter import Eagle3Drafter, Eagle3Model, Eagle3Options
from methods.pld import PLDDrafter, PLDOptions
from methods.sps.drafter import SpSDrafter, SpSOptions
from specbench.engine.batch_cache import RaggedKV, commit_rows
from specbench import metrics
from specbench.engine import MAX_BATCH
from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch
from specbench.engine.batch_target import BatchTarget
from specbench.engine.drafter import DecodeState, Drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.tree import DraftTree
from specbench.engine.vanilla import VanillaDrafter
from specbench.errors import SpecbenchError
from test_deep_sampling import CASES, noisy_copy
from tiny import tiny_llama, tiny_target

# Mixed lengths; the longest is more than twice the others, so rows carry wide dead gaps.
PROMPTS = [[1, 3, 0, 2], [2], [0, 1, 2, 3, 3, 2, 1, 0, 1, 2, 0], [3, 3, 3, 3, 3, 3], [1, 0]]
WIDE_PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41, 12, 50, 4], [9]]
LEARNERS = {"dvi", "dvi-kl", "dvi-pg", "dvi-ce", "specblock-adapt", "specblock-osd", "suffix"}


def ready(drafter: Drafter, target) -> Drafter:
    drafter.setup(target)
    return drafter


def batched(target, drafter, prompts, config, size, continuous=False) -> list:
    queue = deque(BatchRequest(i, p, config) for i, p in enumerate(prompts))
    records = dict((request.key, record) for request, record in
                   generate_batch(target, drafter, queue, BatchConfig(size, continuous)))
    return [records[i] for i in range(len(prompts))]


def alone(target, drafter, prompts, config) -> list:
    return [generate(target, drafter, p, config) for p in prompts]


# ---- the ragged cache, on tensors ------------------------------------------------------------------
def test_commit_rows_moves_each_requests_kept_rows_to_its_own_length():
    torch.manual_seed(0)
    lengths, start, kept = [2, 5, 4], 6, [[0, 2], [0], [0, 1, 3]]
    t = torch.randn(3, 2, start + 4, 5)
    moved = commit_rows(t.clone(), lengths, start, kept)
    assert moved.shape[2] == max(n + len(k) for n, k in zip(lengths, kept))  # 7: cut to the longest
    for b, (n, rows) in enumerate(zip(lengths, kept)):
        assert torch.equal(moved[b, :, :n], t[b, :, :n])  # the committed prefix never moves
        for i, r in enumerate(rows):
            assert torch.equal(moved[b, :, n + i], t[b, :, start + r])


def test_ragged_kv_keeps_rows_apart_as_requests_join_and_leave():
    kv = RaggedKV(heads=2, head_dim=3, device=torch.device("cpu"), dtype=torch.float32)
    kv.add_empty(2)
    block = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).reshape(2, 2, 4, 3)
    kv.keep((block, -block), [range(4), range(1)])
    assert kv.lengths == [4, 1] and kv.width == 4
    assert torch.equal(kv.keys[1, :, :1], block[1, :, :1]) and torch.equal(kv.values[0], -block[0])
    kv.add_empty(1)
    kv.remove([0])
    assert kv.lengths == [1, 0] and kv.width == 1 and torch.equal(kv.keys[0, :, 0], block[1, :, 0])
    assert kv.live().tolist() == [[True], [False]]


# ---- one verify forward for the batch ------------------------------------------------------------
def test_batched_verify_gives_each_request_its_batch1_logits_through_two_steps():
    """Random trees (and an empty one) over prompts of different lengths: the batched forward's logits of
    each request equal batch 1's, and after each request keeps its own random path the next step does too."""
    target = tiny_target(0)
    gen = torch.Generator().manual_seed(1)
    verifier = BatchTarget(target)
    for prompt in WIDE_PROMPTS:
        verifier.join(prompt)
    tokens = [list(p) + [7] for p in WIDE_PROMPTS]  # committed text; the last token is the uncached root
    for step in range(2):
        trees = [random_tree(n, target.vocab_size, gen) for n in (6, 0, 3, 9)]
        packed = verifier.compile_batch([t[-1] for t in tokens], trees)
        outs = verifier.verify(packed, taps=(1,))
        kept = []
        for b, (tree, out) in enumerate(zip(trees, outs)):
            target.prefill(tokens[b][:-1])
            ref = target.verify(target.compile_tree(tokens[b][-1], tree), taps=(1,))
            assert torch.allclose(out.logits, ref.logits, atol=1e-5), (step, b)
            assert torch.allclose(out.taps[1], ref.taps[1], atol=1e-5)
            path = tree.path_to(len(tree) - 1) if len(tree) else []
            kept.append([0] + [node + 1 for node in path])
            tokens[b] += [tree.token_list[n] for n in path] + [int(torch.randint(0, 64, (), generator=gen))]
        verifier.commit(packed, kept)
        assert verifier.lengths == [len(t) - 1 for t in tokens]


# ---- lossless per request at T = 0 ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(set(CASES) - LEARNERS))
def test_every_batchable_method_decodes_each_request_as_batch1_vanilla(name):
    """Static batches of 3 and continuous batches of 2 over prompts of mixed lengths."""
    target, drafter = CASES[name][0]()
    ready(drafter, target)
    config = GenerationConfig(max_new_tokens=24)
    expected = [r.new_tokens for r in alone(target, ready(VanillaDrafter(), target), PROMPTS, config)]
    for size, continuous in ((3, False), (2, True)):
        records = batched(target, drafter, PROMPTS, config, size, continuous)
        assert [r.new_tokens for r in records] == expected, (size, continuous)
        assert all(r.batch["size"] == size and r.batch["continuous"] == continuous for r in records)
    if name != "vanilla":
        assert sum(sum(r.accept_lengths) for r in records) > 0  # drafts were accepted: compaction ran


@pytest.mark.parametrize("name", sorted(set(CASES) - LEARNERS))
def test_batch_of_one_records_what_batch1_records(name):
    target, drafter = CASES[name][0]()
    ready(drafter, target)
    config = GenerationConfig(max_new_tokens=16)
    fields = ("new_tokens", "stop_reason", "n_verify", "accept_lengths", "tree_sizes", "depth_attempts",
              "depth_accepts", "forwards", "extra", "chain_calls", "prompt_tokens")
    for one, base in zip(batched(target, drafter, PROMPTS[:3], config, 1), alone(target, drafter, PROMPTS[:3], config)):
        assert {f: getattr(one, f) for f in fields} == {f: getattr(base, f) for f in fields}
        assert base.batch is None and one.batch["size"] == 1


def sps_and_eagle3():
    target = tiny_target(0, layers=4)
    draft = noisy_copy(target.model, 0.2, 3)
    torch.manual_seed(0)
    eagle3 = Eagle3Model.from_target(target)
    return target, [SpSDrafter(SpSOptions(gamma=4), model=draft),
                    Eagle3Drafter(Eagle3Options(top_k=3, depth=3, total_tokens=12), model=eagle3)]


def test_batched_drafting_drafts_what_each_request_drafts_alone():
    """SpS and EAGLE-3 draft the whole batch in one forward per position/depth: every request's accept
    lengths and tree sizes are those it has alone, so the batched drafts are the per-request drafts."""
    target, drafters = sps_and_eagle3()
    config = GenerationConfig(max_new_tokens=30)
    for drafter in drafters:
        ready(drafter, target)
        assert drafter.batched_drafting
        base = alone(target, drafter, WIDE_PROMPTS, config)
        for size, continuous in ((4, False), (2, True), (3, False)):
            records = batched(target, drafter, WIDE_PROMPTS, config, size, continuous)
            assert [r.new_tokens for r in records] == [r.new_tokens for r in base]
            assert [r.accept_lengths for r in records] == [r.accept_lengths for r in base], (drafter.name, size)
            assert [r.tree_sizes for r in records] == [r.tree_sizes for r in base]
            assert all(r.batch["batched_drafting"] for r in records)
        assert sum(sum(r.accept_lengths) for r in base) > 10


def test_a_neighbour_stopping_at_eos_inside_an_accepted_chain_leaves_the_others_exact():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=30)
    plain = alone(target, ready(VanillaDrafter(), target), WIDE_PROMPTS, config)
    first = plain[0].new_tokens
    eos = next(t for i, t in enumerate(first[5:], 5) if t not in first[:i])  # first ends mid-text at this token
    target.eos_token_ids = {eos}
    expected = [r.new_tokens for r in alone(target, ready(VanillaDrafter(), target), WIDE_PROMPTS, config)]
    # The draft is the target itself: every chain is accepted whole, so the EOS lands inside a chain.
    drafter = ready(SpSDrafter(SpSOptions(gamma=5), model=tiny_llama(0)), target)
    records = batched(target, drafter, WIDE_PROMPTS, config, 4)
    assert [r.new_tokens for r in records] == expected
    assert records[0].stop_reason == "eos" and records[0].new_tokens[-1] == eos
    assert any(len(r.new_tokens) > len(records[0].new_tokens) for r in records[1:])  # others decoded on
    # the chain carried tokens past the EOS (accepted by the verifier), but τ counts only the tokens kept
    first = records[0]
    assert sum(first.depth_accepts) + first.n_verify > first.committed == len(first.new_tokens) - 1


class SplitDrafter(Drafter):
    """For prompts of odd length, the target's own greedy chain (always accepted); for even ones, the
    target's least likely token at every depth (never accepted)."""

    name = "split"

    def propose(self, state: DecodeState) -> DraftTree:
        ids = list(state.tokens)
        with torch.no_grad():
            for _ in range(4):
                logits = self.target.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax() if state.prompt_len % 2 else logits.argmin()))
        return DraftTree.chain(ids[len(state.tokens):])


def test_a_neighbour_accepting_nothing_leaves_the_others_exact():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=25)
    expected = [r.new_tokens for r in alone(target, ready(VanillaDrafter(), target), WIDE_PROMPTS, config)]
    records = batched(target, ready(SplitDrafter(), target), WIDE_PROMPTS, config, 4)
    assert [r.new_tokens for r in records] == expected
    for prompt, record in zip(WIDE_PROMPTS, records):
        assert (min(record.accept_lengths[:-1]) == 4) if len(prompt) % 2 else (max(record.accept_lengths) == 0)


def test_prompt_lookup_neighbours_with_and_without_matches():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=25)
    prompts = [[5, 9, 5, 9, 5, 9, 5, 9, 5], [1, 2, 3, 4, 6, 8, 10]]
    expected = [r.new_tokens for r in alone(target, ready(VanillaDrafter(), target), prompts, config)]
    records = batched(target, ready(PLDDrafter(PLDOptions(gamma=4)), target), prompts, config, 2)
    assert [r.new_tokens for r in records] == expected
    assert not records[0].batch["batched_drafting"]  # prompt lookup drafts per request


# ---- the records' batch metrics --------------------------------------------------------------------
def test_records_carry_the_batch_clock():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=12)
    records = batched(target, ready(VanillaDrafter(), target), WIDE_PROMPTS, config, 2)
    assert [r.batch["group"] for r in records] == [0, 0, 1, 1]  # static: two batches of two
    for r in records:
        assert 0 <= r.batch["start"] < r.batch["end"]
        # its own prefill and every step it shared, never more than its time in the batch
        assert r.total_time <= r.batch["end"] - r.batch["start"] + 1e-9
        assert r.batch["active_mean"] <= 2
    assert records[2].batch["start"] >= max(r.batch["end"] for r in records[:2])  # the second batch waits
    makespan = sum(max(r.batch["end"] for r in g) - min(r.batch["start"] for r in g)
                   for g in (records[:2], records[2:]))
    assert metrics.batch_throughput(records) == pytest.approx(sum(r.num_new for r in records) / makespan)
    latency = sorted(r.batch["end"] - r.batch["start"] for r in records)
    summary = metrics.request_latency(records)
    assert summary["p50"] == pytest.approx((latency[1] + latency[2]) / 2)
    assert latency[2] <= summary["p90"] <= latency[3] and summary["mean"] == pytest.approx(sum(latency) / 4)


def test_continuous_batching_refills_a_slot_at_once():
    target = tiny_target(0)
    configs = [GenerationConfig(max_new_tokens=n) for n in (3, 20, 20)]
    drafter = ready(VanillaDrafter(), target)
    queue = deque(BatchRequest(i, WIDE_PROMPTS[i], c) for i, c in enumerate(configs))
    records = {req.key: rec for req, rec in generate_batch(target, drafter, queue, BatchConfig(2, continuous=True))}
    # request 2 joined when request 0 (3 tokens) left, long before request 1 finished
    assert records[0].batch["end"] <= records[2].batch["start"] < records[1].batch["end"]
    assert {r.batch["group"] for r in records.values()} == {0}


# ---- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LEARNERS - {"suffix"}) + ["sps-heuristic"])
def test_methods_that_learn_while_serving_refuse_a_batch(name):
    if name == "sps-heuristic":
        target, drafter = tiny_target(0), SpSDrafter(SpSOptions(schedule="heuristic"), model=tiny_llama(1))
    else:
        target, drafter = CASES[name][0]()
    ready(drafter, target)
    queue = deque([BatchRequest(0, [1, 2])])
    with pytest.raises(SpecbenchError, match="learns while serving.*--batch-size 1"):
        next(generate_batch(target, drafter, queue, BatchConfig(2)))
    assert len(queue) == 1  # refused before anything ran


def test_batch_size_bounds():
    """A batch built in code is held to the flag's declared range (run_config.RunConfig.batch_size)."""
    for size in (0, MAX_BATCH + 1):
        with pytest.raises(SpecbenchError, match=re.escape(f"--batch-size must be in [1, {MAX_BATCH}] (got {size})")):
            BatchConfig(size)
    assert BatchConfig(MAX_BATCH).size == MAX_BATCH
