"""SpS's dynamic draft length (methods/sps/drafter.py ``schedule``) against transformers' own assisted generation
(``num_assistant_tokens_schedule``, the SpS row of Spec-Bench): on a tiny random target and draft in fp32,
greedy, the same tokens, the same draft length and the same accepted count at every step.

Our engine commits the prefill's token before the first draft while transformers drafts straight after the
prompt, so transformers is started from the prompt plus that token; from there both loops are the same
process. transformers also shortens the last draft to fit max_new_tokens (our engine truncates instead), so it
gets a larger budget and its first steps are compared."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import candidate_generator

from methods.sps.drafter import SpSDrafter, SpSOptions, next_length
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.registry import create_drafter
from specbench.engine.target import Target
from tiny import tiny_llama

NEW = 40
PROMPTS = [[3, 17, 5, 42, 8, 9], [1, 2, 3, 4], [60, 7, 7, 19, 33, 2, 9, 41]]


@pytest.fixture(scope="module")
def pair():
    """A target and a draft that agrees with it often but not always (a noisy copy), so chains are accepted
    whole at some steps and rejected at others."""
    target = tiny_llama(0, init=0.5)
    draft = tiny_llama(0, init=0.5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.35 * p.std() * torch.randn(p.shape, generator=gen))
    return target, draft


def hf_steps(target, draft, ids: list[int], schedule: str, start: int, new: int) -> tuple[list[int], list[tuple]]:
    """transformers' assisted generation from ``ids``: (new tokens, [(drafted, accepted)] per step)."""
    steps = []
    original = candidate_generator.AssistedCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        steps.append((scores.shape[1] - 1, int(num_matches)))
        return original(self, input_ids, scores, num_matches)

    draft.generation_config.num_assistant_tokens = start
    draft.generation_config.num_assistant_tokens_schedule = schedule
    draft.generation_config.assistant_confidence_threshold = 0.0  # later transformers' extra stop rule: off
    candidate_generator.AssistedCandidateGenerator.update_candidate_strategy = record
    try:
        with torch.no_grad():
            out = target.generate(torch.tensor([ids]), assistant_model=draft, do_sample=False, max_new_tokens=new,
                                  pad_token_id=0, eos_token_id=None)
    finally:
        candidate_generator.AssistedCandidateGenerator.update_candidate_strategy = original
    return out[0, len(ids):].tolist(), steps


def ours(target: Target, drafter: SpSDrafter, prompt: list[int]):
    record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=NEW))
    return record, list(zip(record.tree_sizes, record.accept_lengths))


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient"])
def test_schedule_matches_transformers_assisted_generation(pair, schedule):
    target_model, draft_model = pair
    target = Target(target_model, tokenizer=None, name="tiny-0")
    drafter = SpSDrafter(SpSOptions(schedule=schedule), model=draft_model, tokenizer=None)
    drafter.setup(target)
    grew = shrank = 0
    for prompt in PROMPTS:
        start = drafter.length if schedule == "heuristic" else 5  # carried over, or gamma again every turn
        record, steps = ours(target, drafter, prompt)
        hf_tokens, hf = hf_steps(target_model, draft_model, prompt + record.new_tokens[:1], schedule, start, NEW + 40)
        assert record.new_tokens[1:] == hf_tokens[: NEW - 1]
        assert steps == hf[: len(steps)], (steps, hf)
        assert steps[0][0] == start
        grew += sum(a == d for d, a in steps)
        shrank += sum(a < d for d, a in steps)
        assert drafter.length == next_length(steps[-1][0], steps[-1][1], steps[-1][0])
    assert grew and shrank  # both branches of the schedule ran
    if schedule == "heuristic":
        assert drafter.learns  # its state follows the query order (warm-up skipped, resume warns)


def test_fixed_length_is_unchanged_and_heuristic_differs(pair):
    target_model, draft_model = pair
    target = Target(target_model, tokenizer=None, name="tiny-0")
    fixed = SpSDrafter(SpSOptions(gamma=5), model=draft_model, tokenizer=None)
    fixed.setup(target)
    record, _ = ours(target, fixed, PROMPTS[0])
    assert set(record.tree_sizes) == {5} and not fixed.learns and record.extra == {}
    dynamic = SpSDrafter(SpSOptions(schedule="heuristic_transient"), model=draft_model, tokenizer=None)
    dynamic.setup(target)
    other, _ = ours(target, dynamic, PROMPTS[0])
    assert other.new_tokens == record.new_tokens  # lossless either way
    assert len(set(other.tree_sizes)) > 1 and other.extra["mean_gamma"] == pytest.approx(
        sum(other.tree_sizes) / len(other.tree_sizes))


def test_next_length_is_transformers_rule():
    assert next_length(5, 5, 5) == 7 and next_length(5, 4, 5) == 4 and next_length(1, 0, 1) == 1


def test_bad_schedule_is_one_line():
    with pytest.raises(SpecbenchError, match="schedule") as err:
        create_drafter("sps", {"schedule": "linear"})
    assert "\n" not in str(err.value)


def test_bad_schedule_built_in_code_is_the_declarations_one_line():
    with pytest.raises(SpecbenchError) as err:
        SpSDrafter(SpSOptions(schedule="linear"))
    assert "'fixed', 'heuristic', 'heuristic_transient'" in str(err.value) and "\n" not in str(err.value)
