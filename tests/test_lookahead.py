"""Lookahead decoding (methods/lookahead.py): the window as tree nodes at lade's positions, the
n-gram pool, greedy text equal to vanilla with guesses accepted, and option checks."""

import pytest

from methods.lookahead import LookaheadDrafter, LookaheadOptions, NgramPool, window_nodes
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.drafter import DecodeState
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.registry import parse_options
from specbench.engine.verify import SamplingParams
from tiny import tiny_target


def test_full_window_is_lades_2d_window():
    """Column j of level l sits at depth j + l and sees level 0 up to column j and its own column below."""
    drafter = LookaheadDrafter(LookaheadOptions(window=4, ngram=4, guess=2))
    drafter.eos = set()
    drafter.levels = [[11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34]]  # W-1, then W per level
    drafter.fill = 2
    drafter.pool = NgramPool(2)
    drafter.pool.add(7, (1, 2, 3))
    drafter.pool.add(7, (1, 5, 6))
    tree = drafter._tree(7)
    tokens, depths = tree.token_list, tree.depths.tolist()
    assert drafter.guess_nodes == 5  # two 3-grams sharing their first token
    assert tokens[:5] == [1, 5, 6, 2, 3] and depths[:5] == [1, 2, 3, 2, 3]
    where = {t: i for i, t in enumerate(tokens)}
    for j in range(4):
        for level, base in ((1, 20), (2, 30)):
            node = where[base + j + 1]
            assert depths[node] == j + level
            path = [tokens[n] for n in tree.path_to(node)]
            assert path == [11, 12, 13][:j] + [21 + j, 31 + j][:level]
    assert [tokens[n] for n in drafter.top_nodes] == [31, 32, 33, 34]
    assert len(tree) == 5 + window_nodes(4, 4)


def test_pool_keeps_the_most_recent_g():
    pool = NgramPool(2)
    for gram in [(1,), (2,), (1,), (3,)]:
        pool.add(0, gram)
    assert pool.get(0) == [(1,), (3,)]


def run(drafter, target, prompt, n=48, params=SamplingParams()):
    drafter.setup(target)
    return generate(target, drafter, prompt, GenerationConfig(max_new_tokens=n, sampling=params))


@pytest.mark.parametrize("seed,options", [(0, {}), (1, {"window": 3, "ngram": 3, "guess": 4}),
                                          (2, {"pool_from_prompt": True}), (0, {"budget": 40})])
def test_greedy_text_equals_vanilla(seed, options):
    target = tiny_target(seed, vocab=24)
    prompt = [3, 7, 3, 7, 11, 3, 7, 2, 9, 3, 5]
    want = run(VanillaDrafter(), target, prompt).new_tokens
    drafter = LookaheadDrafter(LookaheadOptions(**options))
    record = run(drafter, target, prompt)
    assert record.new_tokens == want
    extra = record.extra
    assert extra["lookahead_steps_with_guess"] > 0 and extra["lookahead_guess_accepted"] > 0, extra
    if options.get("budget"):
        assert max(record.tree_sizes) <= options["budget"]


def test_fill_takes_n_minus_2_steps_without_guesses():
    target = tiny_target(0, vocab=24)
    drafter = LookaheadDrafter(LookaheadOptions(window=4, ngram=5, guess=3))
    record = run(drafter, target, [1, 2, 3, 4, 5], n=12)
    # 5 + 4 - 3 = 6 window tokens at first, one level more per step for N-2 = 3 steps
    assert record.tree_sizes[:3] == [6, 5 + 6, 4 + 2 * 5]


@pytest.mark.parametrize("raw,needle", [({"ngram": "0"}, "ngram"), ({"ngram": "2"}, "ngram"),
                                        ({"window": "0"}, "window"), ({"budget": "20"}, "budget=20")])
def test_bad_options_are_one_line_errors(raw, needle):
    with pytest.raises(SpecbenchError) as err:
        parse_options(LookaheadDrafter, raw)
    assert "\n" not in str(err.value) and needle in str(err.value)


def test_budget_caps_the_step():
    assert LookaheadDrafter.budget_options(64) == {"budget": 64}
    assert window_nodes(7, 5) == 27


def test_a_step_pools_each_columns_ngram_and_moves_the_window_as_lade():
    import torch

    from specbench.engine.drafter import VerifyResult

    drafter = LookaheadDrafter(LookaheadOptions(window=4, ngram=4, guess=2))
    drafter.eos = {43}
    drafter.rng = __import__("random").Random(0)
    drafter.levels = [[11, 12, 13], [21, 22, 23, 24], [31, 32, 33, 34]]
    drafter.fill = 2
    drafter.pool = NgramPool(2)
    drafter.stats = {"window_accepted": 0, "guess_accepted": 0, "guess_nodes": 0, "steps_with_guess": 0}
    tree = drafter._tree(7)
    logits = torch.zeros(len(tree) + 1, 64)
    for j, node in enumerate(drafter.top_nodes):
        logits[node + 1, 40 + j] = 1.0  # the target's argmax after column j's top token: 40 + j
    state = DecodeState(tokens=[1, 2, 7, 9], prompt_len=2, params=SamplingParams())
    drafter.observe(state, VerifyResult(tree, [], [9], 9, logits, {}, 0))
    # column 0's n-gram is keyed by the root, column j's by level 0's token before it
    assert drafter.pool.get(7) == [(21, 31, 40)]
    assert [drafter.pool.get(k) for k in (11, 12, 13)] == [[(22, 32, 41)], [(23, 33, 42)], [(24, 34, 43)]]
    # the window moves one level: level 0 <- level 1 without its first token, top <- the new tokens
    assert drafter.levels[0] == [22, 23, 24] and drafter.levels[1] == [31, 32, 33, 34]
    top = drafter.levels[2]
    assert top[:3] == [40, 41, 42] and top[3] != 43 and top[3] in state.tokens  # EOS redrawn from the text
