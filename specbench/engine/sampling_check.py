"""T = 1 end to end: the tokens the engine itself commits, against the target's exact conditionals.

``draw_sequences`` calls the public ``loop.generate`` N times on one prompt, seeds seed .. seed + N - 1, and
keeps each draw's first K committed tokens (EOS does not stop a draw: the law compared is the plain
conditional). A learning drafter is kept across draws on purpose (its state then differs from draw to
draw, which must not matter); ``fresh=True`` builds a new one per draw instead. Every drafted tree is
hashed per draw (``Draws.trees``), so a run can show that an adaptive drafter changed its trees.

``judge_draws`` compares the sequences with the target's law after each observed prefix, from plain causal
forwards of the target over the prompt and each distinct (K - 1)-token prefix (``ExactLaw``: batched, rows
cached by prefix; a forward gives the law after every prefix of its tokens). Per position k, each observed
prefix's next-token counts against p_target(. | prefix) on the cells of ``replay_stats.cells`` (the 32
likeliest tokens alone, the tail in 8 equal-mass bins), cells expected under 5 times merged, summed over
prefixes (``replay_stats.judge``); all positions together; and the joint law of the first two tokens (pairs
expected 5 times or more alone, the rest one cell). With it, the power: the mean TV per counted token that
the summed test detects with 90% power (``replay_stats.detectable_tv``), and the 99% bound on the mean TV.

What the replay (``replay_check.py``) cannot see and this can: nothing here re-implements the walk, so a
reused or correlated random stream, a commit that differs from what the walk chose, a tree that depends on
the target's draw, or a drafter whose state carries between steps and draws all reach these counts.
``walk_controls.py`` holds the wrong walks that must be caught.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.replay_stats import MIN_EXPECTED, RowTally, Verdict, detectable_tv, judge, tally
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree
from specbench.engine.verify import SamplingParams, TreeRule, choose_rule, logits_to_probs

ALPHA = 1e-3  # a verdict's level, as the replay's (``Verdict.detected``)
POWER = 0.9


class _TreeLog(Drafter):
    """``inner`` as it is, plus a hash of the trees it drafts in one generation and the rule each got."""

    def __init__(self, inner: Drafter, tree_rule: TreeRule | None, rules: Counter) -> None:
        super().__init__()
        self.inner, self.tree_rule, self.rules = inner, tree_rule, rules
        self.name = inner.name
        self.digest = hashlib.blake2b(digest_size=8)

    @property
    def taps(self):  # the loop reads the drafter's taps
        return self.inner.taps

    def begin(self, state: DecodeState, prefill) -> None:
        self.digest = hashlib.blake2b(digest_size=8)
        self.inner.begin(state, prefill)

    def propose(self, state: DecodeState) -> DraftTree:
        tree = self.inner.propose(state)
        self.digest.update(tree.tokens.numpy().tobytes() + b"|" + tree.parents.numpy().tobytes() + b";")
        self.rules[choose_rule(tree, self.tree_rule).value] += 1
        return tree

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        self.inner.observe(state, result)

    def end(self, state: DecodeState) -> dict:
        return self.inner.end(state)


@dataclass
class Draws:
    """N draws of one method on one prompt: the first ``tokens`` committed tokens of each."""

    method: str
    prompt: list[int]
    tokens: int
    params: SamplingParams
    sequences: list[tuple[int, ...]] = field(default_factory=list)
    trees: list[str] = field(default_factory=list)  # per draw: the hash of the trees it drafted
    seeds: list[int] = field(default_factory=list)
    rules: Counter = field(default_factory=Counter)  # rule letter -> verify steps
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    seconds: float = 0.0


def draw_sequences(target: Target, drafter_for: Callable[[], Drafter], prompt: Sequence[int], tokens: int,
                   draws: int, params: SamplingParams = SamplingParams(temperature=1.0), seed: int = 0,
                   fresh: bool = False, tree_rule: TreeRule | None = None, method: str | None = None,
                   drafter: Drafter | None = None) -> Draws:
    """``draws`` generations of ``tokens`` tokens through ``loop.generate``. ``drafter_for()`` returns a
    drafter set up on ``target``; it is called once (``drafter`` given: never), or per draw with ``fresh``."""
    if params.greedy:
        raise ValueError("the end-to-end check samples: give a temperature > 0")
    out = Draws(method or "", [int(t) for t in prompt], tokens, params)
    config = GenerationConfig(max_new_tokens=tokens, sampling=params, tree_rule=tree_rule, stop_on_eos=False)
    start = time.perf_counter()
    for i in range(draws):
        if fresh or drafter is None:
            drafter = drafter_for()
        log = _TreeLog(drafter, tree_rule, out.rules)
        record = generate(target, log, out.prompt, dataclasses.replace(config, seed=seed + i), method=method)
        out.method = out.method or record.method
        out.sequences.append(tuple(record.new_tokens))
        out.trees.append(log.digest.hexdigest())
        out.seeds.append(seed + i)
        out.accepted.extend(record.accept_lengths)
    out.seconds = time.perf_counter() - start
    return out


class ExactLaw:
    """The target's next-token law after ``prompt`` + a prefix, from plain causal forwards (no cache, no
    tree): one per distinct prefix of the longest length asked, batched, every row it gives cached by its
    prefix (float32 on the host; the oldest dropped past ``max_rows``)."""

    def __init__(self, target: Target, prompt: Sequence[int], params: SamplingParams, batch: int = 16,
                 max_rows: int = 4096) -> None:
        self.model, self.device = target.model, target.device
        self.prompt, self.params, self.batch, self.max_rows = [int(t) for t in prompt], params, batch, max_rows
        self.rows: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.forwards = 0

    def ensure(self, prefixes: Sequence[tuple]) -> None:
        """Compute the rows of ``prefixes`` (all of one length) and of all their shorter prefixes."""
        todo = sorted({p for p in prefixes if any(p[:j] not in self.rows for j in range(len(p) + 1))})
        for start in range(0, len(todo), self.batch):
            chunk = todo[start:start + self.batch]
            ids = torch.tensor([self.prompt + list(p) for p in chunk], device=self.device)
            with torch.inference_mode():
                logits = self.model(ids).logits[:, len(self.prompt) - 1:].float()
            self.forwards += 1
            probs = logits_to_probs(logits.reshape(-1, logits.shape[-1]), self.params).reshape(logits.shape).cpu()
            for p, rows in zip(chunk, probs):
                for j in range(len(p) + 1):
                    self.rows[p[:j]] = rows[j].clone()
                    self.rows.move_to_end(p[:j])
        while len(self.rows) > self.max_rows:
            self.rows.popitem(last=False)

    def __call__(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.rows:
            self.ensure([prefix])
        return self.rows[prefix]


@dataclass
class EndToEnd:
    """The verdicts of one method's draws."""

    method: str
    draws: int
    tokens: int
    rules: Counter
    positions: list[Verdict]  # position k (0-based): each observed prefix of length k against its law
    overall: Verdict  # every position's rows together
    joint: Verdict  # the first two tokens as pairs
    tv90: float  # the mean TV per counted token the overall test detects with 90% power
    seconds: float
    mean_accepted: float

    @property
    def p_value(self) -> float:
        """The overall and joint tests, Bonferroni."""
        return min(1.0, 2 * min(self.overall.p_value, self.joint.p_value))

    @property
    def impossible(self) -> int:
        return self.overall.impossible

    def detected(self, alpha: float = ALPHA) -> bool:
        return self.impossible > 0 or self.p_value < alpha


def _counts(next_tokens: Counter, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for token, n in next_tokens.items():
        counts[token] = n
    return counts


def joint_tally(sequences: Sequence[tuple[int, ...]], law: ExactLaw) -> RowTally:
    """The first two tokens as pairs: a pair expected ``MIN_EXPECTED`` times or more is a cell, the other
    pairs one cell. Which pairs stand alone is fixed by the law (every first token expected that often has
    its row computed, seen or not), never by the data."""
    n = len(sequences)
    root = law(()).double()
    firsts = [int(a) for a in torch.nonzero(n * root >= MIN_EXPECTED).flatten()]
    law.ensure([(a,) for a in firsts])
    cells: dict[tuple[int, int], int] = {}
    mass: list[float] = []
    for a in firsts:
        pair = root[a] * law((a,)).double()
        for b in torch.nonzero(n * pair >= MIN_EXPECTED).flatten().tolist():
            cells[(a, b)] = len(mass)
            mass.append(float(pair[b]))
    rest = max(1.0 - sum(mass), 0.0)
    observed = np.zeros(len(mass) + 1, dtype=np.int64)
    impossible = 0
    for seq, count in Counter(s[:2] for s in sequences).items():
        if float(root[seq[0]]) == 0 or float(law(seq[:1])[seq[1]]) == 0:
            impossible += count
        observed[cells.get(seq, len(mass))] += count
    probs = np.asarray(mass + [rest], dtype=np.float64)
    return RowTally(n, observed, probs / probs.sum(), impossible)


def judge_draws(draws: Draws, law: ExactLaw) -> EndToEnd:
    """Every position's prefixes against the target's law (``law``: on the same prompt and parameters)."""
    k_max = draws.tokens
    law.ensure(sorted({s[:k_max - 1] for s in draws.sequences}))
    by_position: list[list[RowTally]] = []
    for k in range(k_max):
        following: dict[tuple, Counter] = defaultdict(Counter)
        for s in draws.sequences:
            following[s[:k]][s[k]] += 1
        rows = []
        for prefix, nxt in sorted(following.items()):
            p = law(prefix)
            rows.append(tally(_counts(nxt, p.numel()), p, []))
        by_position.append(rows)
    overall = judge([t for rows in by_position for t in rows])
    joint = judge([joint_tally(draws.sequences, law)]) if k_max >= 2 else judge([])
    accepted = draws.accepted
    return EndToEnd(draws.method, len(draws.sequences), k_max, draws.rules, [judge(rows) for rows in by_position],
                    overall, joint, detectable_tv(overall.dof, overall.visits, ALPHA, POWER), draws.seconds,
                    sum(accepted) / max(len(accepted), 1))


def changed_trees(draws: Draws, reference: Draws) -> int:
    """Draws, by seed, whose trees differ from the reference run's (e.g. a fresh drafter's) on the same seed."""
    theirs = dict(zip(reference.seeds, reference.trees))
    return sum(seed in theirs and theirs[seed] != mine for seed, mine in zip(draws.seeds, draws.trees))
