"""The forced passes of `specbench run --check forced` (T = 0): after a method's timed turn, the same prompt
again, untimed, with vanilla's tokens committed, and its verify rows compared with vanilla's (``agreement.py``).

1. The method's pass: the method drafts and the target verifies as usual through ``loop.generate``, but the
   walk is ``verify.forced_walk``: a node is accepted when it equals vanilla's next token and the bonus is
   vanilla's, so every committed row has a twin in vanilla's one-row steps. Nothing of the method changes: it
   sees these commits through ``observe`` like any others.
2. The A/A pass: ``OracleChain`` proposes vanilla's own next tokens as a chain with as many nodes as the
   method's tree had at the same step (all accepted): the target runs the method's row counts with no tree
   mask, no gather in the cache, no tree walk.

A method that learns while serving (``Drafter.learns``) runs its pass on a copy (the target's objects shared,
not copied), so what it learns from the check never reaches its next timed turn."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Sequence

import torch

from specbench import agreement
from specbench.engine.drafter import DecodeState, Drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.timing import NullTimer
from specbench.engine.tree import DraftTree
from specbench.records import GenerationRecord


class OracleChain(Drafter):
    """The A/A side: at step s a chain of ``sizes[s]`` nodes of ``tokens`` (vanilla's), cut so the bonus is
    still one of them; after the last size, one-row steps."""

    name = "forced-oracle"

    def __init__(self, tokens: Sequence[int], sizes: Sequence[int]) -> None:
        super().__init__()
        self.tokens = list(tokens)
        self.sizes = iter(list(sizes))

    def propose(self, state: DecodeState) -> DraftTree:
        upcoming = self.tokens[len(state.tokens) - state.prompt_len:]
        return DraftTree.chain(upcoming[: max(0, min(next(self.sizes, 0), len(upcoming) - 1))])


def private_copy(drafter: Drafter, target: Target) -> Drafter:
    """A copy of a learning drafter for the check; the target, its model and every tensor of it are shared."""
    model = target.model
    shared = [target, model, *model.modules(), *model.parameters(), *model.buffers()]
    return copy.deepcopy(drafter, memo={id(x): x for x in shared})


def _forced_pass(target: Target, drafter: Drafter, prompt: list[int], config: GenerationConfig) -> GenerationRecord:
    return generate(target, drafter, prompt, config, timer=NullTimer())


def forced_check(target: Target, drafter: Drafter, vanilla: GenerationRecord, config: GenerationConfig,
                 aa: bool = True) -> dict | None:
    """The forced figures of one method turn against ``vanilla``'s twin turn (generated with ``keep_logits``),
    ``config`` the turn's own; None when vanilla's rows were not kept (a turn of an earlier, resumed run).
    ``aa`` False leaves out the A/A pass (half the forwards) for a caller that reads the method's side only."""
    rows, prompt = getattr(vanilla, "logit_rows", None), getattr(vanilla, "prompt_ids", None)
    if rows is None or prompt is None:
        return None
    forced = replace(config, forced=tuple(vanilla.new_tokens), keep_logits=True)
    ours = _forced_pass(target, private_copy(drafter, target) if drafter.learns else drafter, prompt, forced)
    out = _side(ours, vanilla)
    if aa:
        oracle = OracleChain(vanilla.new_tokens, ours.tree_sizes)
        oracle.setup(target)
        out["aa"] = _side(_forced_pass(target, oracle, prompt, forced), vanilla)
    if target.dtype == torch.float32:  # the engine's claim; bf16 has none (compare with the A/A side)
        out["bound"] = agreement.FP32_BOUND
        for side in (out, out.get("aa")):
            if side is not None:
                side["within_bound"] = agreement.within(side, agreement.FP32_BOUND)
    return out


def _side(record: GenerationRecord, vanilla: GenerationRecord) -> dict:
    return agreement.summarise(record.logit_rows, vanilla.logit_rows, record.new_tokens, vanilla.new_tokens,
                               record.tree_sizes)
