"""T = 1 with power: the engine's acceptance walk replayed many times on captured trees.

* The vectorised replay (specbench/engine/replay.py) commits, walk for walk, what the engine's own
  ``walk`` commits when both read the same random numbers (rules A, B and C, sampled trees redrawn).
* Per registered method, on a tiny random target with the method's tiny drafter (the builds of
  tests/test_deep_sampling.py): every captured step, replayed, follows the target's rows (chi-square
  and a 99% bound on the mean TV per committed token under 0.5%), while the same replay with a 0.5% TV
  bias injected at every row is caught; each tree gets the rule its kind calls for; a sampled tree's q
  is what its tokens were drawn from; the captured rows are a plain causal forward's.
* The q check catches a drafter that declares another q than the one it draws from (which the replay
  itself cannot see: it redraws from the declared q).
* Slow: the same on the real default target with the shipped drafters.
"""

from __future__ import annotations

import functools

import pytest
import torch

from drafters import random_tree
from specbench.engine import verify
from specbench.engine.capture import CapturingDrafter, check_draws
from specbench.engine.drafter import DecodeState, Drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.engine.registry import available_methods, create_drafter
from specbench.engine.replay import Bias, FreshDraws, Tape, cdf_of, inverse_cdf, replay
from specbench.engine.replay_check import CONTROL_TV, replay_check
from specbench.engine.replay_stats import judge, tallies_of, tally
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import SamplingParams, TreeRule, logits_to_probs
from specbench.errors import SpecbenchError
from test_deep_sampling import CASES, PROMPT, params_of
from tiny import tiny_llama, tiny_target

V = 12
WALKS = 3_000
T1 = SamplingParams(temperature=1.0)


# ---- the vectorised walk is the engine's walk -------------------------------------------------------
def favouring(tree: DraftTree, seed: int) -> torch.Tensor:
    """Random logits [N+1, V] that favour each row's drafted children, so walks go deep."""
    logits = torch.randn(len(tree) + 1, V, generator=torch.Generator().manual_seed(seed))
    for child, parent in enumerate(tree.parent_list):
        logits[parent + 1, tree.token_list[child]] += 2.0
    return logits


def sampled_tree(widths: list[int], seed: int, distinct_q: bool = False) -> DraftTree:
    """Siblings drawn i.i.d. from their parent's q; the first child of each level is expanded.
    ``distinct_q``: the second sibling of each family is drawn from a q of its own (refused by rule C)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, qs, parent = [], [], [], -1
    for width in widths:
        q = torch.softmax(2 * torch.randn(V, generator=gen), -1)
        q[:2] = 0.0
        q /= q.sum()
        first = len(tokens)
        for j in range(width):
            row = q
            if distinct_q and j == 1:
                row = torch.softmax(torch.randn(V, generator=gen), -1)
            tokens.append(int(torch.multinomial(row, 1, generator=gen)))
            parents.append(parent)
            qs.append(row)
        parent = first
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), q=torch.stack(qs), kind=SiblingKind.SAMPLED_IID)


def redrawn(tree: DraftTree, tape: Tape, walk: int) -> DraftTree:
    """The tree a sampled walk sees: each node's token drawn again from its q row with the tape's number."""
    if tree.kind == SiblingKind.DETERMINISTIC:
        return tree
    tokens = [int(inverse_cdf(cdf_of(tree.q[c]), tape.nodes[walk, c:c + 1])[0]) for c in range(len(tree))]
    return DraftTree(torch.tensor(tokens), tree.parents, q=tree.q, kind=tree.kind)


def engine_walks(monkeypatch, tree: DraftTree, logits: torch.Tensor, rule: TreeRule, tape: Tape) -> list[list[int]]:
    """verify.walk for each walk, its random draws read from the tape: uniforms and bonus draws (inverse
    CDF) from the walk's stream in the order walk reads them, rule A's per-row draws from its row values."""
    current = {"walk": 0, "read": 0}

    def next_uniform() -> torch.Tensor:
        u = tape.stream[current["walk"], current["read"]]
        current["read"] += 1
        return u

    monkeypatch.setattr(verify, "_uniform", lambda generator=None: float(next_uniform()))
    monkeypatch.setattr(verify, "draw", lambda probs, generator=None: int(
        inverse_cdf(cdf_of(probs.reshape(-1)), next_uniform().reshape(1))[0]))
    monkeypatch.setattr(torch, "multinomial", lambda probs, num, replacement=False, generator=None: torch.stack(
        [inverse_cdf(cdf_of(probs[r]), tape.rows[current["walk"], r:r + 1]) for r in range(probs.shape[0])]))
    out = []
    for w in range(tape.stream.shape[0]):
        current.update(walk=w, read=0)
        seen = redrawn(tree, tape, w)
        result = verify.walk(seen, logits, T1, None, rule)
        tokens = [seen.token_list[c] for c in result.accepted] + [result.bonus]
        # A redrawn node accepted with another token than the captured one leaves the captured rows:
        # the replay counts that token and stops.
        off = [d for d, c in enumerate(result.accepted) if seen.token_list[c] != tree.token_list[c]]
        out.append(tokens[:off[0] + 1] if off else tokens)
    return out


def deterministic_tree(seed: int) -> DraftTree:
    return random_tree(10, V, torch.Generator().manual_seed(seed))


EQUALITY_CASES = {
    "A": (lambda: deterministic_tree(0), TreeRule.SAMPLE_AND_MATCH),
    "B": (lambda: deterministic_tree(1), TreeRule.RECURSIVE_REJECTION),
    "C-chain": (lambda: sampled_tree([1, 1, 1, 1], 2), TreeRule.MULTI_DRAFT),
    "C-siblings": (lambda: sampled_tree([3, 2, 2], 3), TreeRule.MULTI_DRAFT),
    "empty": (DraftTree.empty, TreeRule.SAMPLE_AND_MATCH),
}


@pytest.mark.parametrize("case", list(EQUALITY_CASES))
def test_vectorised_walk_equals_the_engine_walk_on_the_same_numbers(case, monkeypatch):
    make, rule = EQUALITY_CASES[case]
    tree = make()
    logits = favouring(tree, 7)
    probs = logits_to_probs(logits, T1)
    ours = replay(tree, probs, rule, WALKS, Tape(WALKS, 64, len(tree) + 1, torch.Generator().manual_seed(5)),
                  keep_walks=True).walks
    engine = engine_walks(monkeypatch, tree, logits, rule, Tape(WALKS, 64, len(tree) + 1,
                                                               torch.Generator().manual_seed(5)))
    assert ours == engine
    if len(tree):
        assert max(len(w) for w in ours) >= 3  # walks went two nodes deep at least


def test_the_replay_refuses_what_the_engine_refuses():
    tree = sampled_tree([2, 2], 4, distinct_q=True)
    probs = logits_to_probs(favouring(tree, 7), T1)
    for walker in (lambda: verify.walk(tree, favouring(tree, 7), T1, torch.Generator().manual_seed(0)),
                   lambda: replay(tree, probs, TreeRule.MULTI_DRAFT, 10, FreshDraws(torch.Generator()))):
        with pytest.raises(ValueError, match="different q rows"):
            walker()


# ---- the statistics on exact draws and on biased ones -------------------------------------------------
def test_the_tv_bound_holds_exact_draws_and_the_control_is_caught():
    tree = deterministic_tree(2)
    probs = logits_to_probs(favouring(tree, 3), T1)
    source = FreshDraws(torch.Generator().manual_seed(0))
    clean = replay(tree, probs, TreeRule.SAMPLE_AND_MATCH, 400_000, source)
    biased = replay(tree, probs, TreeRule.SAMPLE_AND_MATCH, 400_000, source,
                    Bias(CONTROL_TV, torch.Generator().manual_seed(1)))
    good, bad = judge(tallies_of(clean, probs, tree)), judge(tallies_of(biased, probs, tree))
    assert good.p_value > 1e-3 and good.tv_bound < CONTROL_TV and not good.detected
    assert bad.detected and bad.tv > good.tv_bound
    assert all(abs(tv - CONTROL_TV) < 1e-9 for tv in biased.injected.values())


def test_a_committed_token_the_target_never_samples_fails_outright():
    law = torch.tensor([0.5, 0.5, 0.0])
    row = tally(torch.tensor([500, 499, 1]), law, [])
    assert row.impossible == 1 and judge([row]).detected


# ---- per registered method, on tiny models ----------------------------------------------------------
TINY_REPLAYS = 200_000
TINY_TOKENS = 8
TINY_PROMPTS = 2


@pytest.mark.parametrize("name", list(CASES))  # every registered method (test_deep_sampling checks the list)
def test_each_method_replays_losslessly_on_tiny_models(name):
    target, drafter = CASES[name][0]()
    drafter.setup(target)
    config = GenerationConfig(max_new_tokens=TINY_TOKENS, sampling=params_of(name), seed=0)
    summary = replay_check(target, drafter, [PROMPT] * TINY_PROMPTS, config, TINY_REPLAYS, method=name)
    print(f"{name}: trees={summary.trees} nodes={summary.nodes} rules={dict(summary.rules)} "
          f"clean p={summary.clean.p_value:.3g} tv={summary.clean.tv:.5f} bound={summary.clean.tv_bound:.5f} "
          f"control p={summary.control.p_value:.3g} tv={summary.control.tv:.5f} rows={summary.row_tv_max:.2e} "
          f"{summary.seconds:.1f}s")
    assert summary.trees >= TINY_PROMPTS and (summary.nodes > 0 or name == "vanilla")
    deterministic = summary.kinds[SiblingKind.DETERMINISTIC.value]
    assert summary.rules["A"] == deterministic and summary.rules["C"] == summary.trees - deterministic
    assert summary.draft_checks_failed == 0 and summary.redrawn_nodes == summary.sampled_nodes
    assert summary.deterministic_draws == 0
    assert summary.row_tv_max < 1e-4
    assert summary.clean.p_value > 1e-3 and summary.clean.impossible == 0
    assert summary.clean.tv_bound < CONTROL_TV
    assert summary.control.detected
    assert summary.passed


# ---- the q check ----------------------------------------------------------------------------------------
class MislabelledChain(Drafter):
    """Draws a chain from the draft model at T = 1 but declares q at T = 2: rule C then verifies the
    wrong ratio (the replay alone cannot see it, as it redraws from the declared q)."""

    name = "mislabelled-chain"

    def __init__(self, model, declared_temperature: float) -> None:
        super().__init__()
        self.model, self.declared = model, declared_temperature

    def propose(self, state: DecodeState) -> DraftTree:
        ids, tokens, qs = list(state.tokens), [], []
        for _ in range(3):
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0, -1]
            drawn = logits_to_probs(logits[None], state.params)[0]
            tokens.append(verify.draw(drawn, state.generator))
            qs.append(logits_to_probs(logits[None], SamplingParams(temperature=self.declared))[0])
            ids.append(tokens[-1])
        return DraftTree.chain(tokens, q=torch.stack(qs))


@pytest.mark.parametrize("declared", [1.0, 2.0])
def test_the_q_check_catches_a_declared_q_that_is_not_the_drawn_one(declared):
    target = tiny_target(4, vocab=V, init=0.3)
    drafter = MislabelledChain(tiny_llama(5, vocab=V, init=0.3), declared)
    drafter.setup(target)
    steps = []
    capturing = CapturingDrafter(drafter, steps.append)
    capturing.setup(target)
    for seed in range(4):
        generate(target, capturing, [1, 4, 2], GenerationConfig(max_new_tokens=12, sampling=T1, seed=seed))
    redrawn_nodes = sum(s.check.redrawn for s in steps)
    nodes = sum(len(s.tree) for s in steps)
    assert all(s.rule == TreeRule.MULTI_DRAFT for s in steps)
    if declared == 1.0:
        assert redrawn_nodes == nodes and all(s.check.ok for s in steps)
    else:
        assert redrawn_nodes < nodes and not all(s.check.ok for s in steps)


def test_a_deterministic_tree_that_drew_random_numbers_is_reported():
    tree = deterministic_tree(3)
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    torch.rand((), generator=gen)
    assert check_draws(tree, before, gen.get_state(), torch.device("cpu")).drew
    assert not check_draws(tree, before, before, torch.device("cpu")).drew


# ---- slow: the real default target, the shipped drafters ----------------------------------------------
REAL_PROMPT = "Tell me a short story about a cat."
REAL_REPLAYS = 300_000
REAL_TOKENS = 16


@functools.lru_cache(maxsize=None)
def real_target():
    try:
        return Target.load("smollm2-135m", "float32")
    except SpecbenchError as exc:
        pytest.skip(f"the default target is not installed: {exc}")


# One method per way of drafting and walking (a chain, a copied chain, a sampled tree, a deterministic tree,
# heads, a learner, the paper's method); every registered method replays on tiny targets above and in
# test_deep_sampling.py, and `bench/replay_t1.py` replays them all on the real target with more power.
REAL_METHODS = ("vanilla", "sps", "pld", "eagle3", "medusa", "ddtree", "specblock", "dvi")


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_METHODS)
def test_main_methods_replay_losslessly_on_the_real_target(name):
    assert name in available_methods()
    target = real_target()
    try:
        drafter = create_drafter(name)
        drafter.setup(target)
    except SpecbenchError as exc:  # a drafter folder or an optional package this checkout lacks
        pytest.skip(f"{name}: {exc}")
    ids = render_chat(target.tokenizer, [{"role": "user", "content": REAL_PROMPT}], chat=target.chat)
    summary = replay_check(target, drafter, [ids], GenerationConfig(max_new_tokens=REAL_TOKENS, sampling=T1, seed=0),
                           REAL_REPLAYS, method=name)
    print(f"{name}: trees={summary.trees} rules={dict(summary.rules)} clean p={summary.clean.p_value:.3g} "
          f"bound={summary.clean.tv_bound:.5f} control p={summary.control.p_value:.3g} rows={summary.row_tv_max:.2e}")
    assert summary.passed, summary
