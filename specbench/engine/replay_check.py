"""T = 1 losslessness of one method, with power: capture its real trees, replay each walk many times.

``replay_check`` generates with the method at T > 0 through the engine (``capture.py``), and at every
verify step replays the engine's walk ``replays`` times on the captured tree and rows (``replay.py``):
once as the engine walks, once with a known bias of ``control_tv`` total variation injected at every
row (the negative control, which must be detected). It also checks that each node's q is the one its
token was drawn from and, optionally, that the captured rows are the ones a plain causal forward of
the target gives. ``ReplaySummary`` holds the verdicts (``replay_stats.py``) for a table.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from specbench.engine.capture import CapturedStep, CapturingDrafter, sequential_rows
from specbench.engine.drafter import Drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.replay import Bias, FreshDraws, replay
from specbench.engine.replay_stats import RowTally, Verdict, judge, tallies_of
from specbench.engine.target import Target
from specbench.engine.verify import logits_to_probs

CONTROL_TV = 0.005  # the bias the negative control injects: every row's law off by 0.5% TV


@dataclass
class ReplaySummary:
    method: str
    replays: int  # walks replayed per captured tree
    control_tv: float
    trees: int = 0
    nodes: int = 0  # drafted nodes over all trees
    rules: Counter = field(default_factory=Counter)  # rule letter -> trees
    kinds: Counter = field(default_factory=Counter)  # sibling kind -> trees
    left: int = 0  # replayed walks that accepted a redrawn node outside the captured rows
    draft_checks_failed: int = 0  # trees whose nodes' q is not what their tokens came from
    sampled_nodes: int = 0
    redrawn_nodes: int = 0  # sampled nodes whose draw, repeated from q on the same generator state, agrees
    deterministic_draws: int = 0  # deterministic trees whose propose drew random numbers
    row_tv_max: float | None = None  # largest TV between a captured row and the plain forward's row
    injected_tv: float = 0.0  # the control's mean injected TV per committed token
    seconds: float = 0.0
    clean_rows: list[RowTally] = field(default_factory=list)
    control_rows: list[RowTally] = field(default_factory=list)
    clean: Verdict | None = None
    control: Verdict | None = None

    def finish(self) -> "ReplaySummary":
        self.clean, self.control = judge(self.clean_rows), judge(self.control_rows)
        return self

    @property
    def passed(self) -> bool:
        """Lossless on these trees, and the test had the power to see the control's bias."""
        return (self.clean is not None and not self.clean.detected and self.clean.tv_bound < self.control_tv
                and self.control.detected and self.draft_checks_failed == 0
                and (self.row_tv_max is None or self.row_tv_max < 1e-3))


class _StepReplayer:
    """The ``on_step`` of a capturing drafter: replays every captured step into a summary."""

    def __init__(self, summary: ReplaySummary, seed: int, model=None) -> None:
        self.summary, self.seed, self.model = summary, seed, model
        self.weight = self.injected = 0.0

    def __call__(self, step: CapturedStep) -> None:
        s, tree = self.summary, step.tree
        s.trees += 1
        s.nodes += len(tree)
        s.rules[step.rule.value] += 1
        s.kinds[tree.kind.value] += 1
        s.draft_checks_failed += not step.check.ok
        if step.sampled:
            s.sampled_nodes += len(tree)
            s.redrawn_nodes += step.check.redrawn or 0
        else:
            s.deterministic_draws += bool(step.check.drew)
        probs = logits_to_probs(step.logits, step.params)
        index = self.seed * 1_000_003 + 3 * s.trees  # three generators per tree
        clean = replay(tree, probs, step.rule, s.replays, FreshDraws(torch.Generator().manual_seed(index)))
        s.left += clean.left
        cells: dict = {}
        s.clean_rows += tallies_of(clean, probs, tree, cells)
        biased = replay(tree, probs, step.rule, s.replays, FreshDraws(torch.Generator().manual_seed(index + 1)),
                        Bias(s.control_tv, torch.Generator().manual_seed(index + 2)))
        s.control_rows += tallies_of(biased, probs, tree, cells)
        for row, tv in biased.injected.items():
            visits = biased.visits(row)
            self.weight += visits
            self.injected += visits * tv
        s.injected_tv = self.injected / max(self.weight, 1.0)
        if self.model is not None:
            exact = logits_to_probs(sequential_rows(self.model, step.prefix, tree), step.params)
            tv = float(0.5 * (exact - probs).abs().sum(-1).max())
            s.row_tv_max = tv if s.row_tv_max is None else max(s.row_tv_max, tv)


def replay_check(target: Target, drafter: Drafter, prompts: list[list[int]], config: GenerationConfig,
                 replays: int, seed: int = 0, control_tv: float = CONTROL_TV, check_rows: bool = True,
                 method: str | None = None) -> ReplaySummary:
    """Generate every prompt with ``drafter`` (set up on ``target``) under ``config`` (T > 0; prompt i
    gets seed ``config.seed + i``), replaying every verify step; returns the judged summary."""
    if config.sampling.greedy:
        raise ValueError("the replay checks sampling: give a temperature > 0")
    start = time.perf_counter()
    summary = ReplaySummary(method or drafter.name, replays, control_tv)
    replayer = _StepReplayer(summary, seed, target.model if check_rows else None)
    capturing = CapturingDrafter(drafter, replayer, config.tree_rule)
    capturing.target = target
    for i, ids in enumerate(prompts):
        generate(target, capturing, ids, GenerationConfig(config.max_new_tokens, config.sampling,
                                                          (config.seed or 0) + i, config.tree_rule,
                                                          config.stop_on_eos), method=summary.method)
    summary.seconds = time.perf_counter() - start
    return summary.finish()
