"""The acceptance rules are lossless: with >= 20k samples, the first three committed tokens
follow the target's exact joint distribution (chi^2), for the chain rule and tree rules A, B, C.
A deliberately wrong rule must fail the same test (negative control).

The "target" here is a fixed table p(. | context) so the exact joint is known in closed form;
tests/test_lossless.py runs the same check through the engine with real tiny models."""

import itertools

import pytest
import torch

from stats import chi2_pvalue
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import SamplingParams, TreeRule, WalkResult, walk

V = 5
N_SAMPLES = 20_000
PARAMS = SamplingParams(temperature=1.0)


class Table:
    """Deterministic pseudo-random next-token distributions, peaked enough that drafts get rejected."""

    def __init__(self, seed: int, sharpness: float = 2.0):
        self.seed, self.sharpness, self.memo = seed, sharpness, {}

    def logits(self, ctx: tuple) -> torch.Tensor:
        if ctx not in self.memo:
            g = torch.Generator().manual_seed(hash((self.seed,) + ctx) % (2**31))
            self.memo[ctx] = torch.randn(V, generator=g) * self.sharpness
        return self.memo[ctx]

    def probs(self, ctx: tuple) -> torch.Tensor:
        return self.logits(ctx).softmax(-1)


TARGET = Table(seed=1)
DRAFT = Table(seed=2, sharpness=1.5)


def exact_joint(depth: int) -> dict[tuple, float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=depth):
        p = 1.0
        for i in range(depth):
            p *= float(TARGET.probs(seq[:i])[seq[i]])
        joint[seq] = p
    return joint


def node_context(tree: DraftTree, node: int) -> tuple:
    return tuple(tree.token_list[i] for i in tree.path_to(node)) if node >= 0 else ()


def target_logits(tree: DraftTree) -> torch.Tensor:
    rows = [TARGET.logits(())] + [TARGET.logits(node_context(tree, i)) for i in range(len(tree))]
    return torch.stack(rows)


def first_tokens(result: WalkResult, tree: DraftTree, depth: int, gen: torch.Generator) -> tuple:
    """Committed tokens of one verify call, continued by plain target sampling up to ``depth``
    (exactly what the engine's next iterations would do from a fresh root)."""
    seq = [tree.token_list[i] for i in result.accepted] + [result.bonus]
    while len(seq) < depth:
        seq.append(int(torch.multinomial(TARGET.probs(tuple(seq)), 1, generator=gen)))
    return tuple(seq[:depth])


def deterministic_tree() -> DraftTree:
    # Root has 3 children, one of them a chain of depth 3, another with 2 children.
    return DraftTree(torch.tensor([0, 3, 1, 2, 4, 0, 1]), torch.tensor([-1, -1, -1, 0, 0, 3, 1]))


def sampled_tree(gen: torch.Generator, width: int, without_replacement: bool) -> DraftTree:
    tokens, parents, qs = [], [], []
    frontier = [-1]
    for _ in range(3):
        nxt = []
        for parent in frontier:
            ctx = () if parent < 0 else tuple(tokens[i] for i in path(parents, parent))
            q = DRAFT.probs(ctx)
            picks = torch.multinomial(q, width, replacement=not without_replacement, generator=gen).tolist()
            for t in picks:
                tokens.append(t)
                parents.append(parent)
                qs.append(q)
                nxt.append(len(tokens) - 1)
        frontier = nxt[:1]
    kind = SiblingKind.SAMPLED_WITHOUT_REPLACEMENT if without_replacement else SiblingKind.SAMPLED_IID
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), q=torch.stack(qs), kind=kind)


def path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def run(make_tree, rule, walker=walk, depth: int = 3, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(N_SAMPLES):
        tree = make_tree(gen)
        result = walker(tree, target_logits(tree), PARAMS, gen, rule)
        samples.append(first_tokens(result, tree, depth, gen))
    return samples


CASES = {
    "chain (rule C, one child)": (lambda g: sampled_tree(g, 1, False), None),
    "tree rule A (sample and match)": (lambda g: deterministic_tree(), TreeRule.SAMPLE_AND_MATCH),
    "tree rule B (recursive rejection)": (lambda g: deterministic_tree(), TreeRule.RECURSIVE_REJECTION),
    "tree rule C (i.i.d. siblings)": (lambda g: sampled_tree(g, 3, False), TreeRule.MULTI_DRAFT),
    "tree rule C (without replacement)": (lambda g: sampled_tree(g, 3, True), TreeRule.MULTI_DRAFT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule_is_lossless(case):
    make_tree, rule = CASES[case]
    stat, pvalue = chi2_pvalue(run(make_tree, rule), exact_joint(3))
    print(f"{case}: chi2={stat:.1f} p={pvalue:.3f} n={N_SAMPLES}")
    assert pvalue > 1e-3, f"{case} deviates from the target distribution (chi2={stat:.1f}, p={pvalue:.2e})"


def wrong_chain_rule(tree, logits, params, gen, rule) -> WalkResult:
    """The classic bug: on rejection resample from p instead of the residual max(0, p - q)."""
    probs = logits.softmax(-1)
    accepted, node = [], -1
    for child in range(len(tree)):
        x = tree.token_list[child]
        p, q = float(probs[node + 1][x]), float(tree.q[child][x])
        if float(torch.rand((), generator=gen)) >= min(1.0, p / q):
            return WalkResult(accepted, int(torch.multinomial(probs[node + 1], 1, generator=gen)))
        accepted.append(child)
        node = child
    return WalkResult(accepted, int(torch.multinomial(probs[node + 1], 1, generator=gen)))


def test_negative_control_wrong_rule_is_caught():
    samples = run(lambda g: sampled_tree(g, 1, False), None, walker=wrong_chain_rule)
    stat, pvalue = chi2_pvalue(samples, exact_joint(3))
    print(f"wrong rule: chi2={stat:.1f} p={pvalue:.2e}")
    assert pvalue < 1e-6


def test_rule_a_rejects_sampled_trees_with_rule_b():
    tree = sampled_tree(torch.Generator().manual_seed(0), 2, False)
    with pytest.raises(ValueError, match="deterministic"):
        walk(tree, target_logits(tree), PARAMS, None, TreeRule.RECURSIVE_REJECTION)


# ---- two ways to break rule C that the engine now refuses ----------------------------------------
P_ROW = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
Q_ROW = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)


def rule_c_law(p: torch.Tensor, q: torch.Tensor, siblings: list[int]) -> torch.Tensor:
    """Exact law of the token rule C commits at a row whose siblings are ``siblings`` (verify.py's
    multi_draft_rejection, in float64): accept x with min(1, p/q), else p <- norm(max(0, p - q))."""
    law, reach, residual = torch.zeros_like(p), 1.0, p.clone()
    for x in siblings:
        take = min(1.0, float(residual[x] / q[x]))
        law[x] += reach * take
        reach *= 1 - take
        residual = (residual - q).clamp(min=0)
        residual = residual / residual.sum()
    return law + reach * residual


def two_draw_law(keep) -> torch.Tensor:
    """The committed token's law when two siblings are drawn i.i.d. from Q_ROW and ``keep(x1, x2)``
    says which of them the tree keeps."""
    law = torch.zeros(3, dtype=torch.float64)
    for x1, x2 in itertools.product(range(3), repeat=2):
        law += Q_ROW[x1] * Q_ROW[x2] * rule_c_law(P_ROW, Q_ROW, keep(x1, x2))
    return law


def test_dropping_a_duplicate_iid_sibling_would_bias_rule_c_so_dedup_refuses():
    kept = two_draw_law(lambda a, b: [a, b])
    deduped = two_draw_law(lambda a, b: [a] if a == b else [a, b])
    torch.testing.assert_close(kept, P_ROW)  # duplicates kept: exactly the target's law
    assert 0.5 * float((deduped - P_ROW).abs().sum()) > 0.05  # dropped: 6% TV off
    tree = DraftTree(torch.tensor([2, 2]), torch.tensor([-1, -1]), q=torch.stack([Q_ROW, Q_ROW]).float(),
                     kind=SiblingKind.SAMPLED_IID)
    with pytest.raises(ValueError, match="i.i.d."):
        tree.dedup()


def test_rule_c_refuses_siblings_that_declare_different_q_rows():
    other = torch.tensor([0.1, 0.8, 0.1], dtype=torch.float64)
    # The first sibling from Q_ROW, the second from `other`, both judged with Q_ROW (what rule C reads):
    law = torch.zeros(3, dtype=torch.float64)
    for x1, x2 in itertools.product(range(3), repeat=2):
        law += Q_ROW[x1] * other[x2] * rule_c_law(P_ROW, Q_ROW, [x1, x2])
    assert 0.5 * float((law - P_ROW).abs().sum()) > 0.01
    tree = DraftTree(torch.tensor([2, 1]), torch.tensor([-1, -1]), q=torch.stack([Q_ROW, other]).float(),
                     kind=SiblingKind.SAMPLED_IID)
    with pytest.raises(ValueError, match="different q rows"):
        walk(tree, torch.log(torch.stack([P_ROW] * 3)).float(), PARAMS, torch.Generator().manual_seed(0))
