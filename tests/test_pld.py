"""Prompt-lookup decoding (methods/pld.py): the same drafts as transformers' prompt lookup (same
tokens, same per-step accept lengths), greedy text equal to vanilla, and option checks."""

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from methods.pld import NgramIndex, PLDDrafter, PLDOptions
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.registry import parse_options
from specbench.engine.target import Target
from tiny import tiny_llama

# A prompt with repeats (so lookups hit) whose last token occurs nowhere before it: transformers'
# first call, which looks up the prompt alone, then finds nothing and only decodes one token, like
# our prefill; from there both decode the same text step by step.
PROMPT = [5, 9, 12, 5, 9, 30, 12, 5, 9, 12, 44, 5, 9, 12, 30, 21, 7, 5, 9, 12, 61]
NEW = 48


def transformers_run(model, gamma: int, ngram: int, monkeypatch) -> tuple[list[int], list[int]]:
    matches: list[int] = []
    real = PromptLookupCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return real(self, input_ids, scores, num_matches)

    monkeypatch.setattr(PromptLookupCandidateGenerator, "update_candidate_strategy", record)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=gamma,
                             max_matching_ngram_size=ngram, pad_token_id=0)
    return out[0, len(PROMPT):].tolist(), matches


@pytest.mark.parametrize("gamma,ngram", [(10, 2), (4, 3), (3, 1)])
def test_same_tokens_and_accept_lengths_as_transformers(gamma, ngram, monkeypatch):
    model = tiny_llama(seed=3, vocab=64, layers=2)
    theirs, their_matches = transformers_run(model, gamma, ngram, monkeypatch)
    target = Target(tiny_llama(seed=3, vocab=64, layers=2), tokenizer=None, name="tiny-3")
    drafter = PLDDrafter(PLDOptions(gamma=gamma, ngram=ngram))
    drafter.setup(target)
    record = generate(target, drafter, PROMPT, GenerationConfig(max_new_tokens=NEW))
    assert record.new_tokens == theirs
    assert their_matches[0] == 0  # transformers' prefill step (see PROMPT)
    ours, theirs_steps = record.accept_lengths, their_matches[1:]
    assert len(ours) == len(theirs_steps)
    # transformers caps its last step's matches at the tokens still allowed; our engine truncates after
    # the commit instead, so only the last step may count more.
    assert ours[:-1] == theirs_steps[:-1] and ours[-1] >= theirs_steps[-1]
    assert sum(ours) >= 5  # lookups really hit, so the comparison means something


def test_a_different_match_rule_is_caught(monkeypatch):
    """Negative control: taking the rightmost occurrence instead of the leftmost changes the steps."""
    model = tiny_llama(seed=3, vocab=64, layers=2)
    _, their_matches = transformers_run(model, 10, 2, monkeypatch)

    def rightmost(self, gamma, whole=False):
        length = len(self.tokens)
        for n in range(min(self.max_n, length - 1), 0, -1):
            tail = self.tokens[length - n:]
            for start in range(length - n - 1, -1, -1):
                if self.tokens[start:start + n] == tail:
                    return self.tokens[start + n: start + n + gamma]
        return []

    monkeypatch.setattr(NgramIndex, "continuation", rightmost)
    target = Target(tiny_llama(seed=3, vocab=64, layers=2), tokenizer=None, name="tiny-3")
    drafter = PLDDrafter(PLDOptions(gamma=10, ngram=2))
    drafter.setup(target)
    record = generate(target, drafter, PROMPT, GenerationConfig(max_new_tokens=NEW))
    assert record.accept_lengths[:-1] != their_matches[1:-1]


def test_leftmost_match_longest_ngram_first():
    index = NgramIndex(2)
    index.extend([1, 2, 3, 9, 2, 4, 1, 2, 5, 6, 1, 2])
    assert index.continuation(3) == [3, 9, 2]  # bigram (1, 2): leftmost occurrence
    index.extend([7])
    assert index.continuation(3) == []  # 7 never occurred before: no draft
    index.extend([2])
    assert index.continuation(2) == [3, 9]  # bigram (7, 2) only at the tail; unigram 2: leftmost, index 1


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_text_equals_vanilla(seed):
    target = Target(tiny_llama(seed=seed, vocab=32, layers=2), tokenizer=None, name=f"tiny-{seed}")
    prompt = [3, 7, 3, 7, 11, 3, 7, 2, 9, 3]
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    want = generate(target, vanilla, prompt, GenerationConfig(max_new_tokens=40)).new_tokens
    drafter = PLDDrafter(PLDOptions(gamma=6, ngram=3))
    drafter.setup(target)
    record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40))
    assert record.new_tokens == want
    assert sum(record.accept_lengths) > 0


@pytest.mark.parametrize("raw", [{"ngram": "0"}, {"gamma": "0"}, {"ngram": "-1"}, {"gamma": "x"}])
def test_bad_options_are_one_line_errors(raw):
    with pytest.raises(SpecbenchError) as err:
        parse_options(PLDDrafter, raw)
    assert "\n" not in str(err.value) and "pld" in str(err.value)


def test_budget_sets_gamma():
    assert PLDDrafter.budget_options(7) == {"gamma": 7}


def brute_force(tokens, max_n, gamma, whole):
    """Both rules written out as a scan of every window, left to right."""
    length = len(tokens)
    for n in range(min(max_n, length if whole else length - 1), 0, -1):
        tail = tokens[length - n:]
        for idx in range(length - n + 1):
            if tokens[idx:idx + n] != tail:
                continue
            start = idx + n
            if whole and start + gamma <= length and start < length - n:
                return tokens[start:start + gamma]
            if not whole and start < min(start + gamma, length):
                return tokens[start:start + gamma]
    return []


@pytest.mark.parametrize("whole", [False, True])
def test_index_equals_a_scan_of_every_window(whole):
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        tokens = torch.randint(0, 3 + trial % 5, (1 + trial % 40,), generator=gen).tolist()
        max_n, gamma = 1 + trial % 4, 1 + trial % 6
        index = NgramIndex(max_n)
        index.extend(tokens)
        assert index.continuation(gamma, whole) == brute_force(tokens, max_n, gamma, whole), (tokens, max_n, gamma)


def test_original_rule_greedy_equals_vanilla():
    target = Target(tiny_llama(seed=0, vocab=32, layers=2), tokenizer=None, name="tiny-0")
    prompt = [3, 7, 3, 7, 11, 3, 7, 2, 9, 3]
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    want = generate(target, vanilla, prompt, GenerationConfig(max_new_tokens=40)).new_tokens
    drafter = PLDDrafter(PLDOptions(gamma=4, ngram=3, rule="original"))
    drafter.setup(target)
    assert generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40)).new_tokens == want


def test_drafts_stop_before_eos_as_transformers(monkeypatch):
    """With an EOS id that occurs in the prompt, both cut drafts before it: the same steps and text."""
    model = tiny_llama(seed=3, vocab=64, layers=2, eos=12)
    theirs, their_matches = transformers_run(model, 10, 2, monkeypatch)
    target = Target(tiny_llama(seed=3, vocab=64, layers=2, eos=12), tokenizer=None, name="tiny-3")
    assert 12 in target.eos_token_ids
    drafter = PLDDrafter(PLDOptions(gamma=10, ngram=2))
    drafter.setup(target)
    found, real = [], NgramIndex.continuation
    monkeypatch.setattr(NgramIndex, "continuation",
                        lambda self, *a, **k: found.append(real(self, *a, **k)) or found[-1])
    record = generate(target, drafter, PROMPT, GenerationConfig(max_new_tokens=NEW))
    assert sum(12 in draft for draft in found) >= 2  # drafts really were cut at EOS
    assert record.new_tokens == theirs and their_matches[0] == 0
    if record.stop_reason == "length":
        assert record.accept_lengths[:-1] == their_matches[1:-1]
    else:  # stopped at EOS: transformers' last step is cut there too
        assert record.accept_lengths == their_matches[1:]
