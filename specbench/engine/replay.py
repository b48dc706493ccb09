"""The acceptance walk replayed many times at once on one captured tree (T > 0).

``replay`` runs ``n`` independent walks of rule A, B or C (verify.py) over a tree and its target rows
as tensors, and counts, at every row, the token committed there by the walks that reached that row.
Losslessness says each of those counts is distributed as the row's own target distribution p_row:
the first committed token as p_root, the token after an accepted node as that node's row, and so on
(``replay_stats.py`` tests that).

It is the engine's walk with its random numbers made explicit: every categorical draw is an inverse
CDF of a uniform, and each walk reads its uniforms in the order the engine's walk reads them (rule A:
one per row, as its batched ``multinomial``; rules B and C: one per sibling tried, then one for the
bonus). Fed the same numbers through a ``Tape``, the engine's ``walk`` commits the same tokens
(tests/test_t1_replay.py); ``FreshDraws`` gives new numbers to every read.

Sampled trees (rule C) are redrawn: each node's token is drawn again from its own q row, since a fixed
sampled draft conditions the output. A redrawn node that the walk accepts with another token than
the captured one leaves the captured rows (its own row and its children's q are unknown): the token is
counted at its row and the walk stops there (``left`` counts them). Sampling siblings without
replacement (whose residual depends on which tokens were rejected) is not replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import TreeRule, _normalise


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens drawn by inverse CDF: ``cdf`` [V] float64 cumulative mass, ``u`` [n] uniforms in [0, 1)."""
    index = torch.searchsorted(cdf, u.double() * cdf[-1], right=True)
    return index.clamp_(max=cdf.numel() - 1)


def cdf_of(p: torch.Tensor) -> torch.Tensor:
    return p.double().cumsum(-1)


class FreshDraws:
    """New uniforms for every read, from the replay's own generator. Float64, as float32's 2^-24 steps
    would misplace up to ~1e-7 of mass per token, ~0.1% TV over a 49k vocabulary."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def walk(self, walks: torch.Tensor, count: int) -> torch.Tensor:
        return torch.rand(walks.numel(), count, generator=self.generator, dtype=torch.float64)

    def row(self, walks: torch.Tensor, row: int) -> torch.Tensor:
        return torch.rand(walks.numel(), generator=self.generator, dtype=torch.float64)

    def node(self, walks: torch.Tensor, node: int) -> torch.Tensor:
        return torch.rand(walks.numel(), generator=self.generator, dtype=torch.float64)

    def consumed(self, walks: torch.Tensor, used: torch.Tensor) -> None:
        pass


class Tape:
    """Uniforms drawn in advance: per walk, one stream its walk reads in order (rules B, C), one value per
    row (rule A's per-row draws) and one per node (the redraws of a sampled tree)."""

    def __init__(self, walks: int, length: int, rows: int, generator: torch.Generator) -> None:
        self.stream = torch.rand(walks, length, generator=generator, dtype=torch.float64)
        self.rows = torch.rand(walks, rows, generator=generator, dtype=torch.float64)
        self.nodes = torch.rand(walks, max(rows - 1, 1), generator=generator, dtype=torch.float64)
        self.position = torch.zeros(walks, dtype=torch.long)

    def walk(self, walks: torch.Tensor, count: int) -> torch.Tensor:
        # Reads past the end are never consumed (a walk peeks at more than it may use).
        index = (self.position[walks, None] + torch.arange(count)).clamp(max=self.stream.shape[1] - 1)
        return self.stream[walks[:, None], index]

    def row(self, walks: torch.Tensor, row: int) -> torch.Tensor:
        return self.rows[walks, row]

    def node(self, walks: torch.Tensor, node: int) -> torch.Tensor:
        return self.nodes[walks, node]

    def consumed(self, walks: torch.Tensor, used: torch.Tensor) -> None:
        self.position[walks] += used
        if bool((self.position[walks] > self.stream.shape[1]).any()):
            raise ValueError("the tape ran out: give it a longer stream")


@dataclass(frozen=True)
class Bias:
    """A known error for negative controls: at every row, the committed token is replaced by the row's
    second likeliest token with probability tv / (1 - p(that token)), so each row's law is off by
    exactly ``tv`` in total variation."""

    tv: float
    generator: torch.Generator


@dataclass
class Replay:
    """Per row, the tokens committed there by the walks that reached it."""

    counts: dict[int, torch.Tensor]  # row -> [V] int64 counts
    left: int = 0  # walks that accepted a redrawn node outside the captured rows (stopped there)
    walks: list[list[int]] | None = None  # each walk's committed tokens (keep_walks=True)
    injected: dict[int, float] = field(default_factory=dict)  # row -> TV of the injected bias there

    def visits(self, row: int) -> int:
        return int(self.counts[row].sum())


class _Rows:
    """What the walk reads at each row, computed once per tree with the engine's own operations."""

    def __init__(self, tree: DraftTree, probs: torch.Tensor, rule: TreeRule) -> None:
        self.tree, self.probs, self.rule = tree, probs, rule
        self.kids: dict[int, list[int]] = {}  # rule C keeps duplicate siblings, like the engine
        for child, parent in enumerate(tree.parent_list):
            self.kids.setdefault(parent, []).append(child)
        self._cdf: dict[int, torch.Tensor] = {}
        self._q_cdf: dict[int, torch.Tensor] = {}
        self._chain: dict[int, tuple] = {}

    def cdf(self, row: int) -> torch.Tensor:
        if row not in self._cdf:
            self._cdf[row] = cdf_of(self.probs[row])
        return self._cdf[row]

    def q_cdf(self, node: int) -> torch.Tensor:
        """The CDF of the q row node ``node`` declares it was drawn from."""
        if node not in self._q_cdf:
            self._q_cdf[node] = cdf_of(self.tree.q[node].float().cpu())
        return self._q_cdf[node]

    def child_table(self, node: int) -> torch.Tensor:
        """[V] the row of the child with each token under ``node`` (-1: none), as ``follow`` finds it."""
        table = torch.full((self.probs.shape[1],), -1, dtype=torch.long)
        kids = self.tree.children.get(node, {})
        if kids:
            table[torch.tensor(list(kids))] = torch.tensor(list(kids.values())) + 1
        return table

    def recursive_chain(self, node: int) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
        """Rule B at ``node``'s row: the siblings (token, child), each one's acceptance probability
        after the earlier ones were rejected, and the bonus's CDF after all were."""
        if node not in self._chain:
            row = node + 1
            p = self.probs[row].clone()
            items, accept = list(self.tree.children.get(node, {}).items()), []
            for token, _ in items:
                accept.append(float(p[token]))
                p[token] = 0.0
                p = _normalise(p, self.probs[row])
            self._chain[node] = (items, torch.tensor(accept, dtype=torch.float64), cdf_of(p))
        return self._chain[node]

    def multi_draft_chain(self, node: int) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rule C at ``node``'s row: the children, their shared q, the residual before each sibling
        [m + 1, V], and the bonus's CDF after all were rejected."""
        if node not in self._chain:
            kids = self.kids[node]
            p = self.probs[node + 1].clone()
            q = self.tree.q[kids[0]].to(torch.float32, copy=True).cpu()
            if any(not torch.equal(self.tree.q[k], self.tree.q[kids[0]]) for k in kids[1:]):
                raise ValueError(f"rule C: the children of node {node} declare different q rows")  # as verify.py
            residuals = [p]
            for _ in kids:
                p = _normalise(torch.clamp(p - q, min=0.0), p)
                residuals.append(p)
            self._chain[node] = (kids, q, torch.stack(residuals), cdf_of(p))
        return self._chain[node]


def replay(tree: DraftTree, probs: torch.Tensor, rule: TreeRule, n: int, source, bias: Bias | None = None,
           keep_walks: bool = False) -> Replay:
    """``n`` walks of ``rule`` over ``tree`` with target probabilities ``probs`` ([N+1, V], rows
    [root, nodes...], as ``logits_to_probs`` gives them); ``source`` is a ``FreshDraws`` or ``Tape``."""
    if rule == TreeRule.MULTI_DRAFT and len(tree):
        if tree.q is None:
            raise ValueError("rule C needs the draft distribution q of every node")
        if tree.kind == SiblingKind.SAMPLED_WITHOUT_REPLACEMENT:
            raise ValueError("the replay covers siblings drawn i.i.d.; this tree's were drawn without replacement")
    rows = _Rows(tree, probs.float().cpu(), rule)
    vocab = probs.shape[1]
    result = Replay({}, walks=[[] for _ in range(n)] if keep_walks else None)
    frontier = {0: torch.arange(n)}
    while frontier:
        reached: dict[int, list[torch.Tensor]] = {}
        for row, walks in frontier.items():
            tokens, nxt = _step(rows, row, walks, source, result)
            if bias is not None:
                tokens, nxt = _inject(rows, row, walks, tokens, nxt, bias, result)
            counts = torch.bincount(tokens, minlength=vocab)
            result.counts[row] = counts if row not in result.counts else result.counts[row] + counts
            if keep_walks:
                for w, t in zip(walks.tolist(), tokens.tolist()):
                    result.walks[w].append(t)
            for target in nxt.unique().tolist():
                if target >= 0:
                    reached.setdefault(target, []).append(walks[nxt == target])
        frontier = {row: torch.cat(parts) for row, parts in reached.items()}
    return result


def _first(taken: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether any entry of each row of ``taken`` [w, m] is set, and the index of the first one (m: none)."""
    m = taken.shape[1]
    first = torch.where(taken, torch.arange(m), m).min(1).values if m else torch.zeros(taken.shape[0], dtype=torch.long)
    return first < m, first.clamp(max=max(m - 1, 0))


def _step(rows: _Rows, row: int, walks: torch.Tensor, source, result: Replay) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the walks at ``row`` commit there, and the row each goes on to (-1: the walk ends)."""
    node, tree = row - 1, rows.tree
    if rows.rule == TreeRule.SAMPLE_AND_MATCH:  # y ~ p at every row (one uniform each), follow the matching child
        tokens = inverse_cdf(rows.cdf(row), source.row(walks, row))
        return tokens, rows.child_table(node)[tokens]
    if not rows.kids.get(node):  # a leaf: the bonus, one read
        tokens = inverse_cdf(rows.cdf(row), source.walk(walks, 1)[:, 0])
        source.consumed(walks, torch.ones_like(walks))
        return tokens, torch.full_like(tokens, -1)
    if rows.rule == TreeRule.RECURSIVE_REJECTION:
        items, accept, bonus_cdf = rows.recursive_chain(node)
        m = len(items)
        u = source.walk(walks, m + 1).double()
        hit, first = _first(u[:, :m] < accept[None])
        source.consumed(walks, torch.where(hit, first + 1, m + 1))
        tokens = torch.where(hit, torch.tensor([t for t, _ in items])[first], inverse_cdf(bonus_cdf, u[:, m]))
        return tokens, torch.where(hit, torch.tensor([c + 1 for _, c in items])[first], -1)
    kids, q, residuals, bonus_cdf = rows.multi_draft_chain(node)
    m = len(kids)
    drawn = torch.stack([inverse_cdf(rows.q_cdf(k), source.node(walks, k)) for k in kids], 1)  # [w, m] redrawn
    # Each sibling against the residual it meets; a token drawn from q has q(x) > 0, so the engine reads one
    # uniform per sibling tried, then one for the bonus.
    ratio = (residuals[torch.arange(m)[None], drawn].double() / q[drawn].double()).clamp(max=1.0)
    u = source.walk(walks, m + 1).double()
    hit, first = _first(u[:, :m] < ratio)
    source.consumed(walks, torch.where(hit, first + 1, m + 1))
    bonus = inverse_cdf(bonus_cdf, u[:, m])
    accepted = drawn.gather(1, first[:, None])[:, 0]
    kid_index = torch.tensor(kids)[first]
    on_rows = hit & (accepted == tree.tokens[kid_index])
    result.left += int((hit & ~on_rows).sum())
    return torch.where(hit, accepted, bonus), torch.where(on_rows, kid_index + 1, -1)


def _inject(rows: _Rows, row: int, walks: torch.Tensor, tokens: torch.Tensor, nxt: torch.Tensor, bias: Bias,
            result: Replay) -> tuple[torch.Tensor, torch.Tensor]:
    """``bias`` applied at ``row``: some walks commit the runner-up token instead (and follow its child, if any)."""
    p = rows.probs[row]
    runner_up = int(p.topk(2).indices[1])
    rate = min(1.0, bias.tv / max(1.0 - float(p[runner_up]), 1e-12))
    result.injected[row] = rate * (1.0 - float(p[runner_up]))
    swap = torch.rand(walks.numel(), generator=bias.generator) < rate
    goes = int(rows.child_table(row - 1)[runner_up])
    return torch.where(swap, runner_up, tokens), torch.where(swap, goes, nxt)
