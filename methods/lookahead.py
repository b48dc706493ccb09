"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding", ICML 2024; the authors' package ``lade``, hao-ai-lab/LookaheadDecoding).

No draft model: each target forward carries two branches.

* Lookahead branch: a 2D window of N-1 levels over W columns of a Jacobi iteration. Level 0 is a
  chain after the last committed token; column j of level l (l >= 1) sits at position +j+l and sees
  level 0 up to column j and levels 1..l of its own column. That visibility is a tree path, so the
  whole window is tree nodes here: level 0 a chain from the root, each column a chain hanging off
  its level-0 token. The target's argmax at the top level gives the next Jacobi level; each column
  then yields an n-gram (level-0 token, levels 1..N-2, new token) for the pool, keyed by its first
  token, at most G per key, least recently seen dropped. The window moves one level per step.
* Verification branch: the pool's n-grams keyed by the last committed token, N-1 tokens each,
  merged here into one trie from the root (the same longest accepted prefix as verifying them one
  by one).

As in ``lade``: the window starts as W+N-3 tokens drawn from the prompt and fills one level per
step for N-2 steps without verification; the window is always argmax, also when sampling; an EOS in
a new top level is replaced by a token drawn from the text; the pool is per query, and with
``pool_from_prompt`` it also takes the prompt's and the output's own n-grams (lade's
POOL_FROM_PROMPT, off by default there and here).

Defaults (W, N, G) = (7, 5, 7): lade's README configuration (``config_lade(LEVEL=5, WINDOW_SIZE=7,
GUESS_SET_SIZE=7)``), where the paper's runs on LLaMA-2-7B on an A100 use (15, 5, 15)
(applications/run_mtbench.sh); lade's built-in fallbacks are (60, 8, 60). A step verifies up to
(W-1) + W(N-2) window nodes + G(N-1) guess nodes: 27 + 28 at the defaults.

What differs from the paper, and why:
* Our engine verifies one DraftTree, and any path of it may be accepted. The window's nodes are
  real tree nodes, so when the target's token equals a window token (and no guess already takes
  that path: guess nodes come first among siblings) the walk accepts it. lade never accepts from the
  window. Accepting there is lossless like every accepted path (the node saw exactly the committed
  prefix), and can only lengthen a step; ``end`` reports how many accepted tokens came from the
  window (``lookahead_window_accepted``) so the difference is measured, not hidden.
* At T > 0 the tree is deterministic and the engine's rule A verifies it (sample from the target,
  follow a matching child), where lade uses its own multi-guess rejection; both leave the output
  distributed as the target's.
* lade's prefill also runs level 0 (after the prompt); our prefill is the target's alone, so level 0
  first runs after the first token: the fill takes the same N-2 steps, starting one token later.
* ``budget`` caps the nodes of a step (``--budget``): the window must fit below it, and guesses fill
  what is left, most recently seen first (lade has no cap).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.tree import DraftTree

METHOD = "lookahead"


def window_nodes(window: int, ngram: int) -> int:
    """The most lookahead-branch nodes any step has: the fill steps (level 0 still longer) or the
    full window, (W-1) + W(N-2)."""
    most = window - 1 + window * (ngram - 2)
    for fill in range(ngram - 2):  # before step `fill`: level 0 has W+N-3-fill tokens, levels 1..fill as many + 1
        level0 = window + ngram - 3 - fill
        most = max(most, level0 + fill * (level0 + 1) if fill else level0)
    return most


@dataclass
class LookaheadOptions:
    window: int = option(7, "W: Jacobi window width (lade WINDOW_SIZE).", ge=1)
    ngram: int = option(5, "N: n-gram size, the window has N-1 levels (lade LEVEL).", ge=3,
                        note="lookahead needs at least 2 window levels")
    guess: int = option(7, "G: n-grams kept per first token and verified per step (lade GUESS_SET_SIZE).", ge=1)
    budget: int = option(0, "Most nodes a step verifies (window + guesses); 0 = no cap.", ge=0, tokens=True)
    pool_from_prompt: bool = option(False, "Also pool the prompt's and output's own n-grams (lade POOL_FROM_PROMPT).")
    seed: int = option(0, "Seed of the window's initial tokens (drawn from the prompt).", ge=0)

    def check(self, owner: str) -> None:
        need = window_nodes(self.window, self.ngram)
        if self.budget and need >= self.budget:
            raise SpecbenchError(f"{owner}: the window (W={self.window}, N={self.ngram}) needs {need} nodes, which "
                                 f"leaves no room for guesses within budget={self.budget}; lower window or ngram, or "
                                 f"raise the budget above {need}")


class NgramPool:
    """lade's token_map: first token -> up to G (N-1)-token continuations, least recently seen first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, gram: tuple[int, ...]) -> None:
        grams = self.table.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)
        elif len(grams) >= self.size:
            grams.pop(0)
        grams.append(gram)

    def get(self, key: int) -> list[tuple[int, ...]]:
        return self.table.get(key, [])


class LookaheadDrafter(Drafter):
    name = METHOD
    label = "Lookahead"
    Options = LookaheadOptions
    budget_option = "budget"

    def setup(self, target) -> None:
        super().setup(target)
        self.eos = set(target.eos_token_ids)

    def begin(self, state: DecodeState, prefill) -> None:
        o = self.options
        self.rng = random.Random(o.seed)  # the same window start for a prompt wherever it is in the stream
        prompt = state.tokens[: state.prompt_len]
        self.levels: list[list[int] | None] = [[self.rng.choice(prompt) for _ in range(o.window + o.ngram - 3)]]
        self.levels += [None] * (o.ngram - 2)
        self.fill = 0  # highest filled level
        self.pool = NgramPool(o.guess)
        if o.pool_from_prompt:
            for start in range(len(prompt) - o.ngram + 1):
                self.pool.add(prompt[start], tuple(prompt[start + 1: start + o.ngram]))
        self.stats = {"window_accepted": 0, "guess_accepted": 0, "guess_nodes": 0, "steps_with_guess": 0}

    # ---- one step ---------------------------------------------------------------------------------
    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.phase("tree_build"):
            return self._tree(state.bonus)

    def _tree(self, root: int) -> DraftTree:
        o = self.options
        tokens: list[int] = []
        parents: list[int] = []

        def add(token: int, parent: int) -> int:
            tokens.append(token)
            parents.append(parent)
            return len(tokens) - 1

        full = self.fill == o.ngram - 2
        top_size = len(self.levels[self.fill])
        room = (o.budget - (len(self.levels[0]) + self.fill * top_size)) if o.budget else None
        if full:  # verification branch first, so the walk prefers a guess over a window node
            trie: dict[tuple[int, int], int] = {}
            for gram in reversed(self.pool.get(root)):  # most recently seen first
                parent = -1
                for token in gram:
                    if room is not None and len(tokens) >= room:
                        break
                    key = (parent, token)
                    if key not in trie:
                        trie[key] = add(token, parent)
                    parent = trie[key]
        self.guess_nodes = len(tokens)
        # Lookahead branch: level 0 as a chain from the root (node of level-0 position i; the root is -1).
        chain = [-1]
        for token in self.levels[0]:
            chain.append(add(token, chain[-1]))
        offset = 1 + len(self.levels[0]) - top_size  # level-0 positions before the first column
        column = [chain[offset + j] for j in range(top_size)]
        for level in range(1, self.fill + 1):
            column = [add(self.levels[level][j], column[j]) for j in range(top_size)]
        self.top_nodes = column  # their outputs are the next Jacobi level
        self.root = root
        return DraftTree(tokens, parents) if tokens else DraftTree.empty()

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        o = self.options
        rows = [node + 1 for node in self.top_nodes]
        new = result.logits[rows].argmax(-1).tolist()  # the window is argmax in lade, also when sampling
        accepted = len(result.accepted)
        from_guess = sum(1 for node in result.accepted if node < self.guess_nodes)
        self.stats["guess_accepted"] += from_guess
        self.stats["window_accepted"] += accepted - from_guess
        self.stats["guess_nodes"] += self.guess_nodes
        self.stats["steps_with_guess"] += bool(self.guess_nodes)
        levels = self.levels
        if self.fill < o.ngram - 2:  # filling: every level moves one position, the new one joins on top
            if self.fill == 0:
                levels[0], levels[1] = levels[0][1:], new
            else:
                for level in range(self.fill + 1):
                    levels[level] = levels[level][1:]
                levels[self.fill + 1] = new[1:]
            self.fill += 1
        else:
            # Column j's n-gram: its level-0 token (the root for column 0), levels 1..N-2, the new token.
            for j in range(o.window):
                key = self.root if j == 0 else levels[0][j - 1]
                self.pool.add(key, tuple(levels[level][j] for level in range(1, o.ngram - 1)) + (new[j],))
            levels[0] = levels[1][1:]
            for level in range(1, o.ngram - 2):
                levels[level] = levels[level + 1]
            levels[o.ngram - 2] = new
            top = levels[o.ngram - 2]
            for j, token in enumerate(top):  # lade: too many EOS in the window hurt; redraw them
                if token in self.eos:
                    top[j] = self.rng.choice(state.tokens)
        if o.pool_from_prompt:  # lade appends the n-gram ending at every committed token
            for i in range(len(result.committed)):
                end = len(state.tokens) - len(result.committed) + i + 1
                if end >= o.ngram:
                    self.pool.add(state.tokens[end - o.ngram], tuple(state.tokens[end - o.ngram + 1: end]))

    def end(self, state: DecodeState) -> dict:
        return {"lookahead_window_accepted": self.stats["window_accepted"],
                "lookahead_guess_accepted": self.stats["guess_accepted"],
                "lookahead_guess_nodes": self.stats["guess_nodes"],
                "lookahead_steps_with_guess": self.stats["steps_with_guess"],
                "lookahead_pool_keys": len(self.pool.table)}
