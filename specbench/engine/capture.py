"""Capturing what the engine verified at T > 0: every step's tree, its rule and the target's rows.

``CapturingDrafter`` wraps a method's drafter without changing what it does: around ``propose`` it
keeps the committed prefix and the generator's state, and at ``observe`` it hands ``on_step`` one
``CapturedStep`` (the tree with its node distributions q, the rule ``walk`` chose for it, the
target's logits of every verify row). ``replay.py`` replays the walk on such a step.

Two checks come with a step. ``DraftCheck``: whether each node's q is the distribution its token was
drawn from (a sampled tree's draws are repeated from the generator state ``propose`` started from)
and whether a deterministic tree drew no random numbers. ``sequential_rows``: the target's rows for
the same tree from plain causal forwards of each root-to-leaf path, the rows vanilla decoding would
compute; the replay compares the walk with the captured rows, this compares those rows with vanilla's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specbench.engine import kvcache
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import SamplingParams, TreeRule, choose_rule, draw


@dataclass(frozen=True)
class DraftCheck:
    """Whether a tree's nodes came from the distributions it declares. None: not applicable."""

    nodes: int
    drew: bool | None  # propose drew from the engine's generator (None: the run had no generator)
    redrawn: int | None  # sampled trees: nodes that a draw from their own q row, repeated in node order on the
    #                      generator state propose started from, gives back
    same_stream: bool | None  # and those repeated draws end where propose's did (nothing else drew)
    shared_q: bool | None  # siblings carry one q row (rule C reads the first child's for all of them)
    token_has_mass: bool | None  # q[token] > 0 for every node

    @property
    def ok(self) -> bool:
        checks = (self.same_stream, self.shared_q, self.token_has_mass)
        return all(c is not False for c in checks) and self.redrawn in (None, self.nodes)


@dataclass
class CapturedStep:
    """One verify step as the engine saw it."""

    prefix: list[int]  # committed tokens before the step (prompt + generated); the last is the root b
    tree: DraftTree
    rule: TreeRule  # the rule walk() chose for this tree
    logits: torch.Tensor  # [N+1, V] float32 on the CPU: the target's rows [root, nodes...]
    params: SamplingParams
    committed: list[int]  # what the engine committed at this step
    check: DraftCheck

    @property
    def sampled(self) -> bool:
        return self.tree.kind != SiblingKind.DETERMINISTIC


def check_draws(tree: DraftTree, before: torch.Tensor | None, after: torch.Tensor | None,
                device: torch.device) -> DraftCheck:
    """``before``/``after``: the engine generator's states around ``propose`` (None: no generator)."""
    drew = None if before is None else not torch.equal(before, after)
    if tree.kind == SiblingKind.DETERMINISTIC or tree.q is None:
        return DraftCheck(len(tree), drew, None, None, None, None)
    q = tree.q.float().cpu()
    tokens = tree.tokens
    has_mass = bool((q[torch.arange(len(tree)), tokens] > 0).all())
    shared = True
    for kids in _siblings(tree).values():
        shared &= all(torch.equal(q[kids[0]], q[k]) for k in kids[1:])
    redrawn = same_stream = None
    if before is not None:
        # The engine's drafters sample through verify.draw, one token at a time in node order: the same
        # draws from the same state give the same tokens exactly when q is what they were drawn from.
        scratch = torch.Generator(device=device)
        scratch.set_state(before)
        redrawn = sum(draw(tree.q[i], scratch) == int(tokens[i]) for i in range(len(tree)))
        same_stream = torch.equal(scratch.get_state(), after)
    return DraftCheck(len(tree), drew, redrawn, same_stream, shared, has_mass)


def _siblings(tree: DraftTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for child, parent in enumerate(tree.parent_list):
        kids.setdefault(parent, []).append(child)
    return kids


class CapturingDrafter(Drafter):
    """``inner`` as it is, plus one ``on_step(CapturedStep)`` call per verify step (T > 0 only).
    ``tree_rule`` is the generation's ``GenerationConfig.tree_rule`` (None: the engine's default)."""

    def __init__(self, inner: Drafter, on_step: Callable[[CapturedStep], None], tree_rule: TreeRule | None = None):
        super().__init__()
        self.inner, self.on_step, self.tree_rule = inner, on_step, tree_rule
        self.name = inner.name

    @property
    def taps(self):  # the loop reads the drafter's taps after setup
        return self.inner.taps

    def setup(self, target) -> None:
        self.target = target
        self.inner.setup(target)

    def begin(self, state: DecodeState, prefill) -> None:
        self.inner.begin(state, prefill)

    def propose(self, state: DecodeState) -> DraftTree:
        gen = state.generator
        self.prefix = list(state.tokens)
        before = gen.get_state() if gen is not None else None
        tree = self.inner.propose(state)
        after = gen.get_state() if gen is not None else None
        self.check = check_draws(tree, before, after, gen.device if gen is not None else torch.device("cpu"))
        return tree

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        if not state.params.greedy:
            self.on_step(CapturedStep(self.prefix, result.tree, choose_rule(result.tree, self.tree_rule),
                                      result.logits.detach().float().cpu(), state.params, list(result.committed),
                                      self.check))
        self.inner.observe(state, result)

    def end(self, state: DecodeState) -> dict:
        return self.inner.end(state)


@torch.inference_mode()
def sequential_rows(model, prefix: list[int], tree: DraftTree) -> torch.Tensor:
    """[N+1, V] float32 logits of rows [root, nodes...] from plain causal forwards: the prefix once,
    then every root-to-leaf path at once on top of its cache (one batch row per leaf, right-padded;
    the root row is the last prefix token's)."""
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    paths = [tree.path_to(leaf) for leaf in tree.leaves()] or [[]]
    width = 1 + max(len(path) for path in paths)
    ids = torch.full((len(paths), width), prefix[-1], dtype=torch.long)
    for i, path in enumerate(paths):
        ids[i, 1:len(path) + 1] = torch.tensor([tree.token_list[n] for n in path], dtype=torch.long)
    start = len(prefix) - 1
    cache = DynamicCache()
    if start:
        model(input_ids=torch.tensor([prefix[:-1]], device=device),
              position_ids=torch.arange(start, device=device)[None], use_cache=True, **kvcache.cache_arg(model, cache))
        cache.batch_repeat_interleave(len(paths))
    positions = torch.arange(start, start + width, device=device).expand(len(paths), -1)
    logits = model(input_ids=ids.to(device), position_ids=positions, use_cache=True,
                   **kvcache.cache_arg(model, cache)).logits.float().cpu()
    rows = torch.empty(len(tree) + 1, logits.shape[-1])
    rows[0] = logits[0, 0]
    for i, path in enumerate(paths):
        rows[[n + 1 for n in path]] = logits[i, 1:len(path) + 1]
    return rows
