"""The compiled engine (``--engine compiled``): a static KV cache and ``torch.compile``d forwards at bucketed row
counts, lossless like the eager one.

- the cache and mask surgery (static-width mask, padded rows, in-buffer commit, prefill in chunks, growth)
  agree with a plain causal forward within fp32 rounding;
- every registered method's greedy text equals vanilla's under the compiled engine (tiny models, fp32);
- T = 1 through the compiled engine passes the chi-square tests of test_deep_sampling, for a chain method
  and a tree method, and their negative controls fail them;
- graph builds are taken out of the clock (``outside_clock``) and happen once per row bucket.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from drafters import random_tree
from specbench.engine.compiled_forward import BUCKETS, CAPACITY_STEP, bucket
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.timing import PhaseTimer
from specbench.engine.tree import DraftTree
from specbench.engine.vanilla import VanillaDrafter
from specbench.errors import SpecbenchError
from stats import loglik_z, sequential_chi2
from test_deep_sampling import (CASES, DEPTH, PROMPT, break_step, exact_law, params_of, verifier_accepts)
from tiny import tiny_llama

ATOL = 1e-4  # fp32: the same arithmetic in another kernel order


def compiled(target: Target) -> Target:
    """The same model (weights shared) behind the compiled engine."""
    return Target(target.model, target.tokenizer, target.name, engine="compiled")


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_buckets_cover_every_row_count():
    assert [bucket(n) for n in (1, 2, 3, 5, 17, 64, 65, 128)] == [1, 2, 4, 8, 32, 64, 128, 128]
    with pytest.raises(ValueError):
        bucket(BUCKETS[-1] + 1)


def test_tree_verify_and_commit_agree_with_a_plain_forward():
    """Random trees verified and random root paths committed, step after step: every verify row's logits
    equal a plain forward over the committed text and that row's ancestors."""
    model = tiny_llama(3, vocab=50, layers=2)
    target = compiled(Target(model))
    gen = torch.Generator().manual_seed(0)
    text = [5, 9, 2, 31, 7]
    target.prefill(text)
    for step in range(12):
        tree = random_tree(int(torch.randint(1, 20, (1,), generator=gen)), 50, gen)
        root = int(torch.randint(0, 50, (1,), generator=gen))
        out = target.verify(target.compile_tree(root, tree))
        parents = tree.parents.tolist()
        for row in range(len(tree) + 1):
            path, node = [], row - 1
            while node >= 0:
                path.append(tree.token_list[node])
                node = parents[node]
            expected = plain_logits(model, text + [root] + path[::-1])[-1]
            torch.testing.assert_close(out.logits[row].float(), expected, atol=ATOL, rtol=0)
        leaf = int(torch.randint(0, len(tree), (1,), generator=gen))
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        rows = [0] + [n + 1 for n in path[::-1]]
        target.commit(rows)
        text += [root] + [tree.token_list[n] for n in path[::-1]]
        assert target.length == len(text) == target.cache_length()


def test_long_prompt_prefills_in_chunks_and_the_cache_grows():
    model = tiny_llama(4, vocab=64, layers=2)
    target = compiled(Target(model))
    first = target.static.cache.capacity
    prompt = torch.randint(0, 64, (BUCKETS[-1] * 2 + 37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert len(prompt) > first == CAPACITY_STEP
    out = target.prefill(prompt, taps=(1, -1))
    plain = plain_logits(model, prompt)
    torch.testing.assert_close(out.logits[-1].float(), plain[-1], atol=ATOL, rtol=0)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.taps[1], hidden[1][0], atol=ATOL, rtol=0)
    assert out.taps[-1].shape == (len(prompt), 32)
    assert target.static.cache.capacity >= len(prompt) and target.static.cache.capacity % CAPACITY_STEP == 0
    # a growth mid-request keeps the rows; a chain verify after it
    target.reserve(target.static.cache.capacity + 1)
    chain = DraftTree.chain(torch.tensor([11, 3, 60, 8]))
    out = target.verify(target.compile_tree(7, chain))
    torch.testing.assert_close(out.logits[-1].float(), plain_logits(model, prompt + [7] + chain.token_list)[-1],
                               atol=ATOL, rtol=0)


def test_graphs_are_built_once_per_bucket_outside_the_clock():
    target = compiled(Target(tiny_llama(5, vocab=40)))
    drafter = vanilla_on(target)
    config = GenerationConfig(max_new_tokens=6)
    first = generate(target, drafter, [1, 2, 3], config)
    assert first.outside_clock.get("graph_compile", 0) > 0  # prefill's bucket and the one-row verify
    assert target.static.built == {0, 1}  # a CPU's two graphs: one row, and any other count (symbolic rows)
    again = generate(target, drafter, [4, 5, 6], config)
    assert again.outside_clock == {} and again.to_dict().get("outside_clock") is None
    eager = Target(target.model)
    assert again.new_tokens == generate(eager, vanilla_on(eager), [4, 5, 6], config).new_tokens


def vanilla_on(target: Target) -> VanillaDrafter:
    drafter = VanillaDrafter()
    drafter.setup(target)
    return drafter


def test_paused_span_leaves_every_open_phase():
    timer = PhaseTimer("cpu")
    with timer.phase("verify"), timer.forward("target"):
        with timer.paused("graph_compile"):
            sum(range(200_000))
    assert timer.paused_ns["graph_compile"] > 0
    assert timer.ns["verify"] >= 0 and timer.forward_ns["target"] >= 0
    assert timer.ns["verify"] < timer.paused_ns["graph_compile"]


def test_engine_choice_is_checked():
    with pytest.raises(SpecbenchError, match="unknown engine"):
        Target(tiny_llama(0), engine="fast")
    from specbench.engine.target import check_engine_setup

    with pytest.raises(SpecbenchError, match="--attn sdpa"):
        check_engine_setup("compiled", "flash", None)
    with pytest.raises(SpecbenchError, match="one device"):
        check_engine_setup("compiled", "sdpa", "auto")


def test_cpu_tuning_level_is_read_and_checked(monkeypatch):
    from specbench.engine.compiled_forward import TUNING_ENV, tuning_level

    for level in ("0", "1", "2"):
        monkeypatch.setenv(TUNING_ENV, level)
        assert tuning_level() == int(level)
    monkeypatch.delenv(TUNING_ENV)
    assert tuning_level() == 2  # autotuned matmuls unless told otherwise
    monkeypatch.setenv(TUNING_ENV, "max")
    with pytest.raises(SpecbenchError, match="use 0 .* 1 .* or 2"):
        tuning_level()


# ---- every registered method, greedy, tiny models -------------------------------------------------
GREEDY_PROMPTS = [PROMPT, [2, 2, 1, 0, 3, 1]]


@pytest.mark.parametrize("name", list(CASES))
def test_every_method_greedy_equals_vanilla_compiled(name):
    build, _ = CASES[name]
    eager_target, drafter = build()
    target = compiled(eager_target)
    drafter.setup(target)
    baseline = vanilla_on(target)
    config = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    accepted = 0
    for prompt in GREEDY_PROMPTS:
        record = generate(target, drafter, prompt, config)
        expected = generate(target, baseline, prompt, config).new_tokens
        assert record.new_tokens == expected, name
        accepted += sum(record.accept_lengths)
        # the eager engine over the same weights writes the same text (fp32; tiny models have no near-ties)
        assert generate(eager_target, vanilla_on(eager_target), prompt, config).new_tokens == expected
    if name != "vanilla":
        assert accepted > 0, name  # drafts were accepted: commits moved rows inside the static buffers


# ---- T = 1 through the compiled engine --------------------------------------------------------------
SAMPLES, ALPHA = 200, 1e-4


def sampled_pvalue(name: str, samples: int) -> tuple[float, np.ndarray]:
    build, _ = CASES[name]
    eager_target, drafter = build()
    target = compiled(eager_target)
    drafter.setup(target)
    config = GenerationConfig(max_new_tokens=DEPTH, sampling=params_of(name))
    sequences, accepted = [], []
    for seed in range(samples):
        record = generate(target, drafter, PROMPT, dataclasses.replace(config, seed=seed))
        sequences.append(tuple(record.new_tokens))
        accepted.extend(verifier_accepts(record))
    conditional, prefix_prob = exact_law(eager_target, sequences, params_of(name))
    _, _, p_chi2 = sequential_chi2(sequences, conditional, prefix_prob)
    _, p_ll = loglik_z(sequences, conditional)
    return min(1.0, 2 * min(p_chi2, p_ll)), np.array(accepted)


@pytest.mark.parametrize("name", ["sps", "eagle3"])
def test_sampling_through_the_compiled_engine_matches_the_target(name):
    p, accepted = sampled_pvalue(name, SAMPLES)
    assert np.sum(accepted >= 3) >= 10  # deep acceptances: compaction inside the static buffers ran
    assert p > ALPHA


@pytest.mark.parametrize("name", ["sps", "eagle3"])
def test_a_broken_step_is_caught_through_the_compiled_engine(name, monkeypatch):
    break_step(monkeypatch, CASES[name][1])
    p, _ = sampled_pvalue(name, 150)
    assert p < ALPHA
