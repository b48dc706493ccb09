"""Suffix decoding (methods/suffix.py): greedy text equal to vanilla, the cross-request memory
following the stream (a repeated query drafts from the earlier response), and option checks."""

import pytest

from methods.suffix import SuffixDrafter, SuffixOptions, arctic_available
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.registry import parse_options
from tiny import tiny_target

needs_arctic = pytest.mark.skipif(not arctic_available(), reason="arctic-inference is not installed (extra 'suffix')")


def run(drafter, target, prompt, n=40):
    return generate(target, drafter, prompt, GenerationConfig(max_new_tokens=n))


@needs_arctic
@pytest.mark.parametrize("seed,options", [(0, {}), (1, {"tree": False}), (2, {"max_spec": 4, "spec_factor": 2.0})])
def test_greedy_text_equals_vanilla_and_memory_helps(seed, options):
    target = tiny_target(seed, vocab=48)
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    drafter = SuffixDrafter(SuffixOptions(**options))
    drafter.setup(target)
    prompts = [[3, 7, 3, 7, 11, 3, 7, 2, 9, 3], [5, 1, 8, 20, 33], [3, 7, 3, 7, 11, 3, 7, 2, 9, 3]]
    records = []
    for prompt in prompts:
        want = run(vanilla, target, prompt).new_tokens
        record = run(drafter, target, prompt)
        assert record.new_tokens == want
        records.append(record)
    if options.get("max_spec"):
        assert max(max(r.tree_sizes) for r in records) <= options["max_spec"]
    # The third query repeats the first: the global tree holds its response, so most steps draft deep.
    first, third = records[0], records[2]
    assert third.extra["suffix_memory"] == 3
    assert sum(third.accept_lengths) > sum(first.accept_lengths)
    assert len(third.accept_lengths) < len(first.accept_lengths)


@needs_arctic
def test_memory_is_what_a_repeat_drafts_from():
    """Control: with the memory of one response, the response before the previous one is gone."""
    target = tiny_target(0, vocab=48)
    a, b = [3, 7, 3, 7, 11, 3, 7, 2, 9, 3], [5, 1, 8, 20, 33]
    small = SuffixDrafter(SuffixOptions(memory=1))
    small.setup(target)
    large = SuffixDrafter(SuffixOptions())
    large.setup(target)
    for drafter in (small, large):
        for prompt in (a, b):
            run(drafter, target, prompt)
    assert sum(run(large, target, a).accept_lengths) > sum(run(small, target, a).accept_lengths)


@needs_arctic
@pytest.mark.parametrize("memory", [100000, 2])
def test_a_copy_drafts_as_the_original_and_its_learning_stays_its_own(memory):
    """The forced check runs a learning drafter's pass on a deep copy: the suffix drafter's copy rebuilds the
    C++ global tree from the kept responses (after FIFO eviction with memory=2), so it drafts exactly as
    the original does, and what the copy then learns never reaches the original."""
    import copy

    target = tiny_target(0, vocab=48)
    a, b, c = [3, 7, 3, 7, 11, 3, 7, 2, 9, 3], [5, 1, 8, 20, 33], [9, 9, 4, 2, 17]
    drafter = SuffixDrafter(SuffixOptions(memory=memory))
    drafter.setup(target)
    for prompt in (a, b, c):
        run(drafter, target, prompt)
    twin = copy.deepcopy(drafter, memo={id(target): target})
    assert twin.target is target and twin.cache is not drafter.cache
    assert list(twin.cache.cached_requests) == list(drafter.cache.cached_requests)
    assert len(drafter.responses) == min(memory, 3)
    probe = [drafter.responses[r][i:i + 4] for r in drafter.responses for i in (0, 9)] + [a[:4]]

    def drafts(d):
        return [(x.token_ids, x.parents, x.score) for x in (d.cache.speculate("probe", ctx, max_spec_tokens=16)
                                                            for ctx in probe)]

    drafter.cache.start_request("probe", [])  # speculate needs an active request (a new id: an old one is evicted)
    twin.cache.start_request("probe", [])
    assert drafts(twin) == drafts(drafter)
    before = drafts(drafter)
    assert sum(len(tokens) > 2 for tokens, _, _ in before) >= 2  # the probes match earlier responses
    twin.cache.stop_request("probe")
    run(twin, target, a)  # the copy learns a response the original never saw
    assert run(twin, target, b).extra["suffix_memory"] == min(memory, 6)
    assert drafts(drafter) == before and len(drafter.cache.cached_requests) == min(memory, 4)
    drafter.cache.stop_request("probe")


@pytest.mark.parametrize("raw,needle", [({"memory": "0"}, "memory"), ({"max_spec": "0"}, "max_spec"),
                                        ({"min_prob": "2"}, "min_prob")])
def test_bad_options_are_one_line_errors(raw, needle):
    with pytest.raises(SpecbenchError) as err:
        parse_options(SuffixDrafter, raw)
    assert "\n" not in str(err.value) and needle in str(err.value)


def test_budget_sets_max_spec():
    assert SuffixDrafter.budget_options(12) == {"max_spec": 12}
    assert SuffixDrafter.learns  # its memory follows the stream: no warm-up, no --repeats


@needs_arctic
@pytest.mark.parametrize("tree", [True, False])
def test_the_prompts_suffix_tree_drafts_a_frequency_tree(tree):
    """"5 1 2" was followed by 3 twice and by 4 once in the prompt: a tree holds both, a chain the likelier."""
    from specbench.engine.drafter import DecodeState
    from specbench.engine.verify import SamplingParams

    target = tiny_target(0, vocab=48)
    drafter = SuffixDrafter(SuffixOptions(tree=tree, spec_factor=4.0))
    drafter.setup(target)
    prompt = [5, 1, 2, 3, 9, 5, 1, 2, 4, 8, 5, 1, 2, 3, 9, 7, 5, 1]
    state = DecodeState(tokens=prompt + [2], prompt_len=len(prompt), params=SamplingParams())
    drafter.begin(state, None)
    draft = drafter.propose(state)
    first = [draft.token_list[i] for i in draft.child_indices(-1)]
    assert first[0] == 3 and (sorted(first) == [3, 4]) == tree
    assert draft.token_list[draft.child_indices(draft.token_list.index(3))[0]] == 9  # 3 was followed by 9
