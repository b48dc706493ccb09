"""DraftTree: the one data structure every drafter hands to the engine.

Nodes are stored in topological order (parent < child). The root is the bonus token b, which is
*not* a node: first-level nodes have ``parent == -1`` and depth 1. Structure (depths, ancestor
mask, child lookup) is derived here, lazily; the engine's ``compile`` phase turns a tree into the
verify inputs (``Target.compile_tree``: positions and mask on the device via ``verify_visibility``).
Drafters build trees through the constructor and never write the derived fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
import torch


class SiblingKind(str, Enum):
    """How a parent's children were chosen; decides which lossless rule may verify them."""

    DETERMINISTIC = "deterministic"  # top-k, heap, rank buckets, argmax chains: rule A (or B)
    SAMPLED_IID = "sampled_iid"  # drawn i.i.d. from q: rule C
    SAMPLED_WITHOUT_REPLACEMENT = "sampled_without_replacement"  # rule C, q shrinks on rejection


def verify_visibility(parents: torch.Tensor) -> torch.Tensor:
    """[N+1, N+1] bool over rows/cols [root, nodes...] from a parent vector, computed on the
    parents' device with no host loop or sync (so a GPU verify needs no host-built mask): row r
    sees column c iff c is the root or an ancestor-or-self of r. Equal to
    ``DraftTree.verify_mask()``; the transitive closure is repeated squaring of I + parent edges,
    ceil(log2 N) small matmuls."""
    n = parents.numel()
    device = parents.device
    reach = torch.zeros(n, n, dtype=torch.float32, device=device)
    # Edge i -> parent(i); children of the root write a 0 (into column 0) that the identity fixes up.
    reach.scatter_(1, parents.clamp(min=0).unsqueeze(1), (parents >= 0).float().unsqueeze(1))
    reach += torch.eye(n, device=device)
    for _ in range(max(0, (n - 1).bit_length())):
        reach = (reach @ reach).clamp_(max=1.0)
    visible = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    visible[:, 0] = True
    visible[1:, 1:] = reach > 0
    return visible


@dataclass(eq=False)
class DraftTree:
    """Parallel arrays over N nodes.

    tokens:  [N] target-vocabulary ids.
    parents: [N] index of the parent node, -1 for children of the root (the bonus token).
    scores:  [N] optional cumulative draft log-probabilities (used for dedup and pruning).
    q:       [N, V] optional draft distribution each node was drawn from (its parent's
             proposal, in target vocabulary, tempered and filtered exactly as sampled).
             Required for sampled kinds at temperature > 0.
    kind:    how siblings were chosen (one kind per tree).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor | None = None
    q: torch.Tensor | None = None
    kind: SiblingKind = SiblingKind.DETERMINISTIC
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1).cpu()
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1).cpu()
        if self.tokens.shape != self.parents.shape:
            raise ValueError("tokens and parents must have the same length")
        n = self.tokens.numel()
        if n and bool((self.parents >= torch.arange(n)).any()):
            raise ValueError("nodes must be in topological order (parent index < node index)")
        if n and bool((self.parents < -1).any()):
            raise ValueError("parent indices must be >= -1")
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError("q must have one row per node")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens, q: torch.Tensor | None = None, kind: SiblingKind | None = None) -> "DraftTree":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.arange(tokens.numel()) - 1
        if kind is None:
            kind = SiblingKind.DETERMINISTIC if q is None else SiblingKind.SAMPLED_IID
        return cls(tokens, parents, q=q, kind=kind)

    # ---- derived structure --------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tokens.numel())

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def token_list(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def depths(self) -> torch.Tensor:
        """Depth of each node; children of the root have depth 1."""
        depth = [0] * len(self)
        for i, p in enumerate(self.parent_list):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return torch.tensor(depth, dtype=torch.long)

    @cached_property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, torch.arange(len(self)) - 1))

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: anc[i, j] is True iff j is i or an ancestor of i."""
        n = len(self)
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parent_list):
            if p >= 0:
                anc[i] |= anc[p]
        return anc

    @cached_property
    def children(self) -> dict[int, dict[int, int]]:
        """parent index (-1 = root) -> {token: child index}, siblings in node order."""
        table: dict[int, dict[int, int]] = {}
        for i, (p, t) in enumerate(zip(self.parent_list, self.token_list)):
            table.setdefault(p, {}).setdefault(t, i)
        return table

    def child_indices(self, parent: int) -> list[int]:
        return list(self.children.get(parent, {}).values())

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent_list[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(p for p in self.parent_list if p >= 0)
        return [i for i in range(len(self)) if i not in has_child]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths (EAGLE's retrieve_indices)."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    # ---- verify inputs ------------------------------------------------------------------
    def position_offsets(self) -> torch.Tensor:
        """Offsets added to the cache length P for rows [root, nodes...]."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.depths])

    def verify_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over rows/cols [root, nodes...]: row r sees column c iff c is the root
        or an ancestor-or-self of r. The cached prefix columns are added by the target."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask
        return mask

    # ---- cleanup ------------------------------------------------------------------------
    def dedup(self) -> "DraftTree":
        """Drop duplicate siblings (same parent, same token), keeping the higher score.

        Duplicates waste verify budget and make the walk ambiguous; dropping one (and its subtree)
        is valid for deterministic siblings (rules A and B). Not for siblings drawn i.i.d. (rule C):
        a duplicate is always rejected there, but its rejection still moves the residual
        (p <- norm(max(0, p - q))), so dropping it changes the bonus's law; such trees are refused.
        """
        if self.kind == SiblingKind.SAMPLED_IID:
            raise ValueError("dedup would change rule C's residuals: siblings drawn i.i.d. keep their duplicates")
        keep: list[int] = []
        best: dict[tuple[int, int], int] = {}
        remap: dict[int, int] = {-1: -1}
        scores = self.scores.tolist() if self.scores is not None else [0.0] * len(self)
        # Pick the winner per (new parent, token) first, so a later higher-scored duplicate wins.
        order = sorted(range(len(self)), key=lambda i: (self.depths[i].item(), -scores[i], i))
        alive = set()
        for i in order:
            p = self.parent_list[i]
            if p >= 0 and p not in alive:
                continue
            key = (p, self.token_list[i])
            if key in best:
                continue
            best[key] = i
            alive.add(i)
        keep = sorted(alive)
        if len(keep) == len(self):
            return self
        for new, old in enumerate(keep):
            remap[old] = new
        idx = torch.tensor(keep, dtype=torch.long)
        parents = torch.tensor([remap[self.parent_list[i]] for i in keep], dtype=torch.long)
        return DraftTree(
            self.tokens[idx],
            parents,
            scores=None if self.scores is None else self.scores[idx],
            q=None if self.q is None else self.q[idx],
            kind=self.kind,
            meta=dict(self.meta),
        )
