"""End to end through the engine with tiny real models: greedy output equals the baseline token
for token, and at T = 1 the committed tokens follow the target's exact distribution."""

import dataclasses

import pytest
import torch

from drafters import RandomTreeDrafter, RandomTreeOptions, SampledTreeDrafter, SampledTreeOptions
from methods.sps.drafter import SpSDrafter, SpSOptions
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.verify import SamplingParams
from stats import chi2_pvalue
from tiny import tiny_llama, tiny_target

PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41]]

def ready(drafter, target):
    drafter.setup(target)
    return drafter

def baseline(target, prompt, config):
    return generate(target, ready(VanillaDrafter(), target), prompt, config).new_tokens

def manual_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]

def test_vanilla_equals_plain_greedy_loop():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=30)
    for prompt in PROMPTS:
        assert baseline(target, prompt, config) == manual_greedy(target.model, prompt, 30)

@pytest.mark.parametrize("draft_seed,gamma", [(0, 4), (1, 3), (2, 1), (3, 7)])
def test_sps_greedy_equals_baseline(draft_seed, gamma):
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=40)
    # draft_seed 0 is the target itself (everything accepted); the others reject often.
    drafter = ready(SpSDrafter(SpSOptions(gamma=gamma), model=tiny_llama(draft_seed)), target)
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        assert len(record.new_tokens) == 40 and record.stop_reason == "length"
    if draft_seed == 0:
        assert record.accept_lengths[:-1] == [gamma] * (len(record.accept_lengths) - 1)

@pytest.mark.parametrize("nodes", [1, 6, 20])
def test_random_trees_greedy_equal_baseline(nodes):
    target = tiny_target(1)
    config = GenerationConfig(max_new_tokens=40)
    drafter = ready(RandomTreeDrafter(RandomTreeOptions(nodes=nodes, seed=nodes), oracle=target.model), target)
    accepted = 0
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        accepted += sum(record.accept_lengths)
    assert accepted > 0  # the planted branch makes the walk go deep, exercising compaction

def test_eos_stops_generation_and_is_kept():
    target = tiny_target(0)
    plain = manual_greedy(target.model, PROMPTS[0], 30)
    eos = plain[5]
    target.eos_token_ids = {eos}
    record = generate(target, ready(SpSDrafter(SpSOptions(gamma=4), model=tiny_llama(0)), target),
                      PROMPTS[0], GenerationConfig(max_new_tokens=30))
    assert record.new_tokens == plain[: plain.index(eos) + 1] and record.stop_reason == "eos"

# ---- T = 1 through the engine ------------------------------------------------------------------
V = 8
SAMPLES = 2_500  # the 20k-sample checks of each rule are in test_sampling_rules.py

def exact_first_two(target, prompt):
    with torch.no_grad():
        p1 = target.model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        joint = {}
        for a in range(V):
            p2 = target.model(torch.tensor([prompt + [a]])).logits[0, -1].float().softmax(-1)
            for b in range(V):
                joint[(a, b)] = float(p1[a] * p2[b])
    return joint

@pytest.mark.parametrize("make", [
    lambda: SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(5, vocab=V, init=0.3)),
    lambda: SpSDrafter(SpSOptions(gamma=3, draft_temperature=0.4), model=tiny_llama(5, vocab=V, init=0.3)),
    lambda: RandomTreeDrafter(RandomTreeOptions(nodes=5, seed=3)),
    lambda: SampledTreeDrafter(SampledTreeOptions(width=2, depth=2), model=tiny_llama(6, vocab=V, init=0.3)),
], ids=["sps-chain", "sps-chain-draft-temperature", "random-tree-rule-A", "sampled-tree-rule-C"])
def test_engine_sampling_matches_target_distribution(make):
    target = tiny_target(4, vocab=V, init=0.3)
    prompt = [1, 4, 2]
    drafter = ready(make(), target)
    params = SamplingParams(temperature=1.0)
    samples = []
    for seed in range(SAMPLES):
        record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=2, sampling=params, seed=seed))
        samples.append(tuple(record.new_tokens[:2]))
    stat, pvalue = chi2_pvalue(samples, exact_first_two(target, prompt))
    print(f"chi2={stat:.1f} p={pvalue:.3f} n={SAMPLES}")
    assert pvalue > 1e-3

def test_sps_draft_temperature_changes_q_only():
    """The target as its own draft: at the run's temperature q = p and every draft is accepted; at another
    draft temperature some are rejected, and the committed tokens still follow p (the chi-square test above)."""
    target = tiny_target(4, vocab=V, init=0.3)
    config = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=1.0))

    def accepted(draft_temperature: float) -> tuple[int, int]:
        drafter = ready(SpSDrafter(SpSOptions(gamma=3, draft_temperature=draft_temperature),
                                   model=tiny_llama(4, vocab=V, init=0.3)), target)
        records = [generate(target, drafter, [1, 4, 2], dataclasses.replace(config, seed=s)) for s in range(20)]
        return sum(sum(r.accept_lengths[:-1]) for r in records), sum(3 * (len(r.accept_lengths) - 1) for r in records)

    same, drafted = accepted(0.0)
    assert drafted > 0 and same == drafted
    sharp, drafted = accepted(0.3)
    assert 0 < sharp < drafted


def test_seeded_sampling_is_reproducible():
    target = tiny_target(4, vocab=V, init=0.3)
    drafter = ready(SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(5, vocab=V, init=0.3)), target)
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=11)
    assert generate(target, drafter, [1, 2], config).new_tokens == generate(target, drafter, [1, 2], config).new_tokens
