"""Test drafters built on the real protocol: random trees exercise every verify/commit path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.engine.drafter import DecodeState, Drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.verify import logits_to_probs


def random_tree(n: int, vocab: int, generator: torch.Generator, max_children: int = 3) -> DraftTree:
    """A random prefix-closed tree of n nodes with distinct sibling tokens."""
    parents, tokens = [], []
    used: dict[int, set[int]] = {}
    for i in range(n):
        while True:
            p = int(torch.randint(-1, i, (), generator=generator))
            if len(used.get(p, ())) < max_children:
                break
        while True:
            t = int(torch.randint(0, vocab, (), generator=generator))
            if t not in used.setdefault(p, set()):
                break
        used[p].add(t)
        parents.append(p)
        tokens.append(t)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


@dataclass
class RandomTreeOptions:
    nodes: int = 8
    seed: int = 0


class RandomTreeDrafter(Drafter):
    """Proposes random deterministic trees, planting the target's greedy path sometimes so that
    deep acceptances happen; its q is irrelevant (deterministic siblings use rule A/B)."""

    name = "random-tree"
    Options = RandomTreeOptions

    def __init__(self, options=None, oracle=None) -> None:
        super().__init__(options)
        self.gen = torch.Generator().manual_seed(self.options.seed)
        self.oracle = oracle  # optional tiny model whose greedy tokens seed one branch

    def propose(self, state: DecodeState) -> DraftTree:
        vocab = self.target.vocab_size
        tree = random_tree(self.options.nodes, vocab, self.gen)
        if self.oracle is None:
            return tree
        # Replace the first chain of the tree with the oracle's greedy continuation.
        ids = torch.tensor([state.tokens])
        tokens = tree.tokens.clone()
        node = 0
        with torch.no_grad():
            for depth in range(3):
                if node >= len(tree):
                    break
                nxt = int(self.oracle(ids).logits[0, -1].argmax())
                siblings = [c for c in range(len(tree)) if tree.parent_list[c] == tree.parent_list[node] and c != node]
                if any(int(tokens[c]) == nxt for c in siblings):
                    break
                tokens[node] = nxt
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
                kids = [c for c in range(len(tree)) if tree.parent_list[c] == node]
                if not kids:
                    break
                node = kids[0]
        return DraftTree(tokens, tree.parents)


def tree_against_vanilla(target: Target, n: int, max_new: int = 40) -> list[tuple[list[int], object, object]]:
    """(prompt, tree record, vanilla record) of n random 6-token prompts at T = 0: a random tree with the
    target's greedy path planted against vanilla, the pairs the divergence rules judge."""
    drafter = RandomTreeDrafter(RandomTreeOptions(nodes=8, seed=1), oracle=target.model)
    drafter.setup(target)
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    config = GenerationConfig(max_new_tokens=max_new)
    out = []
    for p in range(n):
        prompt = torch.randint(0, target.vocab_size, (6,), generator=torch.Generator().manual_seed(p)).tolist()
        out.append((prompt, generate(target, drafter, prompt, config), generate(target, vanilla, prompt, config)))
    return out


@dataclass
class SampledTreeOptions:
    width: int = 2
    depth: int = 2
    temperature: float = 1.0
    without_replacement: bool = False


class SampledTreeDrafter(Drafter):
    """Draws each node's children from a draft model's distribution (rule C trees)."""

    name = "sampled-tree"
    Options = SampledTreeOptions

    def __init__(self, options=None, model=None) -> None:
        super().__init__(options)
        self.model = model

    def _q(self, ids: list[int], state: DecodeState) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(torch.tensor([ids], device=self.model.device)).logits[0, -1]
        return logits_to_probs(logits.unsqueeze(0), state.params)[0]

    def propose(self, state: DecodeState) -> DraftTree:
        o = self.options
        tokens, parents, qs = [], [], []
        frontier = [(-1, list(state.tokens))]
        for _ in range(o.depth):
            nxt = []
            for parent, ctx in frontier:
                q = self._q(ctx, state)
                if o.without_replacement:
                    picks = torch.multinomial(q, o.width, replacement=False, generator=state.generator).tolist()
                else:
                    picks = torch.multinomial(q, o.width, replacement=True, generator=state.generator).tolist()
                for t in picks:
                    tokens.append(t)
                    parents.append(parent)
                    qs.append(q)
                    nxt.append((len(tokens) - 1, ctx + [t]))
            frontier = nxt[:1]  # expand only the first child, keeps the tree small
        kind = SiblingKind.SAMPLED_WITHOUT_REPLACEMENT if o.without_replacement else SiblingKind.SAMPLED_IID
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), q=torch.stack(qs), kind=kind)
