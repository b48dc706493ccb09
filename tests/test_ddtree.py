"""DDTree (methods/ddtree.py): Algorithm 1 returns exactly the top-B prefixes by Π q (brute force),
the compiled tree is prefix-closed with depth positions and the ancestor mask, greedy output equals
the baseline, and at T = 1 the committed tokens follow the target's exact distribution (rule A)."""

import itertools
import math

import pytest
import torch

from methods.dflash.drafter import DFlashModel
from methods.ddtree import DDTreeDrafter, DDTreeOptions, best_first_prefixes, compile_tree, ddtree_from_log_probs
from specbench.engine.registry import create_drafter, method_class
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.tree import DraftTree
from specbench.engine.verify import SamplingParams
from stats import chi2_pvalue
from test_dflash import BLOCK, PROMPTS, baseline, ready, target, trained  # noqa: F401 (shared module fixtures)
from tiny import tiny_target


def random_marginals(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked random log-marginals [depth, vocab] (continuous, so prefix products have no ties)."""
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(depth, vocab, generator=gen)).log_softmax(-1)


def brute_force_top(log_q: torch.Tensor, budget: int) -> list[tuple[tuple[int, ...], float]]:
    """Every prefix of every length, scored by Σ log q, best ``budget`` first."""
    depth, vocab = log_q.shape
    scored = []
    for d in range(1, depth + 1):
        for tokens in itertools.product(range(vocab), repeat=d):
            scored.append((tokens, sum(float(log_q[i, t]) for i, t in enumerate(tokens))))
    scored.sort(key=lambda x: -x[1])
    return scored[:budget]


def prefixes_of(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.token_list[n] for n in tree.path_to(i)) for i in range(len(tree))]


# ---- Algorithm 1 -----------------------------------------------------------------------------
@pytest.mark.parametrize("depth,vocab,budget", [(1, 5, 3), (2, 4, 7), (3, 4, 20), (4, 3, 40), (3, 5, 1), (3, 6, 64),
                                                (2, 3, 50)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heap_returns_exactly_the_top_b_prefixes(depth, vocab, budget, seed):
    log_q = random_marginals(depth, vocab, seed)
    tree = ddtree_from_log_probs(log_q, budget)
    expected = brute_force_top(log_q, budget)  # (2, 3, 50) asks for more than the 12 prefixes there are
    assert len(tree) == min(budget, sum(vocab ** d for d in range(1, depth + 1)))
    assert set(prefixes_of(tree)) == {tokens for tokens, _ in expected}
    for i, tokens in enumerate(prefixes_of(tree)):
        assert float(tree.scores[i]) == pytest.approx(sum(float(log_q[d, t]) for d, t in enumerate(tokens)), abs=1e-5)


def test_pops_are_best_first_and_pushes_follow_algorithm_1():
    log_q = random_marginals(3, 4, 5).tolist()
    log_q = [sorted(row, reverse=True) for row in log_q]
    popped = best_first_prefixes(log_q, 30)
    scores = [s for _, s in popped]
    assert scores == sorted(scores, reverse=True)
    assert popped[0] == ((1,), pytest.approx(log_q[0][0]))
    seen = set()
    for rho, score in popped:  # every tuple's predecessor (sibling-1 or parent) was popped before it
        pred = rho[:-1] + (rho[-1] - 1,) if rho[-1] > 1 else rho[:-1]
        assert not pred or pred in seen
        assert score == pytest.approx(sum(log_q[d][r - 1] for d, r in enumerate(rho)))
        seen.add(rho)
    # K = min(B, V): with B = 2 no rank above 2 can ever be pushed.
    assert all(max(rho) <= 2 for rho, _ in best_first_prefixes(log_q, 2))


@pytest.mark.parametrize("budget", [1, 5, 16, 60])
def test_tree_is_prefix_closed_with_depth_positions_and_ancestor_mask(budget):
    log_q = random_marginals(BLOCK - 1, 9, budget)
    tree = ddtree_from_log_probs(log_q, budget)
    prefixes = prefixes_of(tree)
    assert set(p[:-1] for p in prefixes if len(p) > 1) <= set(prefixes)  # prefix-closed
    for i, p in enumerate(tree.parent_list):
        assert p < i and (p < 0 or tree.scores[i] <= tree.scores[p])
    for parent, kids in tree.children.items():  # distinct siblings (ranks are distinct tokens)
        assert len(kids) == len(tree.child_indices(parent))
    fresh = DraftTree(tree.tokens, tree.parents)  # the same tree with nothing pre-computed
    assert torch.equal(tree.depths, fresh.depths) and torch.equal(tree.ancestor_mask, fresh.ancestor_mask)
    assert tree.position_offsets().tolist() == [0] + [len(p) for p in prefixes]
    assert int(tree.depths.max()) <= BLOCK - 1


def test_tree_maps_draft_vocabulary_to_target_ids():
    log_q = random_marginals(2, 4, 0)
    tree = ddtree_from_log_probs(log_q, 6, to_target_ids=lambda ids: ids * 10 + 1)
    plain = ddtree_from_log_probs(log_q, 6)
    assert tree.token_list == [t * 10 + 1 for t in plain.token_list] and tree.parent_list == plain.parent_list


def test_surrogate_value_is_optimal():
    """Prop. 1: Σ_{u in T} q(u) is the surrogate's expected acceptance; no valid B-node tree beats ours."""
    log_q = random_marginals(3, 3, 4)
    tree = ddtree_from_log_probs(log_q, 6)
    ours = sum(math.exp(float(s)) for s in tree.scores)
    best = sum(math.exp(s) for _, s in brute_force_top(log_q, 6))
    assert ours == pytest.approx(best) and len(compile_tree([], [])) == 0


# ---- through the engine ----------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 4, 16, 48])
def test_greedy_equals_baseline(target, trained, budget):
    drafter = ready(DDTreeDrafter(DDTreeOptions(budget=budget), model=trained), target)
    config = GenerationConfig(max_new_tokens=40)
    accepted, sizes = 0, set()
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        accepted += sum(record.accept_lengths)
        sizes |= set(record.tree_sizes)
    assert accepted > 0 and sizes == {budget} and record.extra["budget"] == budget


V = 8
SAMPLES = 1_500  # the 20k-sample check of rule A itself is in test_sampling_rules.py


def test_sampling_matches_target_distribution():
    """T = 1 through the engine: the first two committed tokens follow the target exactly (rule A
    over a 6-node DDTree of a DFlash drafter that disagrees with the target)."""
    small = tiny_target(4, vocab=V, init=0.3)
    torch.manual_seed(3)
    model = DFlashModel.from_target(small, layers=1, block_size=4, mask_token_id=V - 1, target_layer_ids=[0]).eval()
    drafter = ready(DDTreeDrafter(DDTreeOptions(budget=6), model=model), small)
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.0)
    samples = [tuple(generate(small, drafter, prompt, GenerationConfig(max_new_tokens=2, sampling=params,
                                                                       seed=seed)).new_tokens[:2])
               for seed in range(SAMPLES)]
    with torch.no_grad():
        p1 = small.model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        exact = {}
        for a in range(V):
            p2 = small.model(torch.tensor([prompt + [a]])).logits[0, -1].float().softmax(-1)
            exact.update({(a, b): float(p1[a] * p2[b]) for b in range(V)})
    stat, pvalue = chi2_pvalue(samples, exact)
    print(f"chi2={stat:.1f} p={pvalue:.3f} n={SAMPLES}")
    assert pvalue > 1e-3


def test_options_and_registration():
    assert method_class("ddtree") is DDTreeDrafter
    assert create_drafter("ddtree", {"budget": "64"}).options.budget == 64
    with pytest.raises(SpecbenchError, match="budget"):
        DDTreeDrafter(DDTreeOptions(budget=0))
