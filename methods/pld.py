"""PLD: prompt-lookup decoding, the draft-free n-gram copier (Saxena 2023; transformers'
``generate(prompt_lookup_num_tokens=...)``, vLLM's ``ngram`` proposer).

Each step looks for the text's last n tokens earlier in the committed text (prompt + generated),
n from ``ngram`` down to 1, and drafts the up to ``gamma`` tokens that followed the match, as one
chain. The choices follow transformers' ``PromptLookupCandidateGenerator`` exactly, so the same
settings give the same drafts (tests/test_pld.py checks tokens and per-step accept lengths):

* n runs from min(ngram, length - 1) down to 1; the first n with a usable match wins;
* of the occurrences of the last n tokens, the leftmost one with at least one token after it
  (the tail itself never qualifies: nothing follows it);
* the draft is cut before its first EOS token; if that leaves nothing, there is no draft this
  step (transformers then decodes one token, and so do we: an empty tree).

Where transformers scans every window per step, we keep, per n, the first position of every
n-gram seen so far and extend it with each committed token: the same leftmost match in O(1).

``rule=original`` instead follows the original prompt-lookup code (apoorvumang/prompt-lookup-decoding,
copied into Spec-Bench as model/pld/pld.py): a match counts only if a whole ``gamma``-token
continuation follows it and it starts before the last 2n tokens, and drafts are not cut at EOS.

One known difference: transformers, at its first call, looks up the prompt before the target has
produced a token (prefill and the first verify share a forward); our engine's prefill yields the
first token, so our first lookup already sees it. From the second transformers step on, both look
up the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.options import option
from specbench.engine.tree import DraftTree

METHOD = "pld"


@dataclass
class PLDOptions:
    # transformers' defaults: prompt_lookup_num_tokens has none (its class default is 10), and
    # max_matching_ngram_size defaults to 2.
    gamma: int = option(10, "Longest draft (transformers' prompt_lookup_num_tokens).", ge=1, tokens=True)
    ngram: int = option(2, "Longest n-gram matched, tried longest first down to 1 "
                           "(transformers' max_matching_ngram_size).", ge=1)
    rule: Literal["transformers", "original"] = option(
        "transformers", "Which matches count: transformers' (any continuation) or the original PLD code's "
                        "(a whole gamma-token continuation; Spec-Bench's PLD row).")


class NgramIndex:
    """First position of every n-gram (n = 1..max_n) in a growing token list."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # by n

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.first[n].setdefault(tuple(self.tokens[end - n:]), end - n)

    def continuation(self, gamma: int, whole: bool = False) -> list[int]:
        """The tokens after the leftmost earlier occurrence of the longest matching tail (or []).
        ``whole``: the original PLD rule, only a match followed by ``gamma`` tokens that starts before
        the last 2n tokens (both bounds on the start, so the leftmost occurrence passes if any does)."""
        length = len(self.tokens)
        top = min(self.max_n, length if whole else length - 1)
        for n in range(top, 0, -1):
            start = self.first[n].get(tuple(self.tokens[length - n:]))
            if start is None:
                continue
            if whole:
                if start + n + gamma <= length and start + n < length - n:
                    return self.tokens[start + n: start + n + gamma]
            elif start + n < length:  # the tail is in the index too; an earlier occurrence has a token after it
                return self.tokens[start + n: min(start + n + gamma, length)]
        return []


class PLDDrafter(Drafter):
    name = METHOD
    label = "Prompt lookup"
    Options = PLDOptions
    budget_option = "gamma"

    def setup(self, target) -> None:
        super().setup(target)
        self.eos = set(target.eos_token_ids)

    def begin(self, state: DecodeState, prefill) -> None:
        self.index = NgramIndex(self.options.ngram)
        self.index.extend(state.tokens)
        self.drafted = 0
        self.steps_with_draft = 0

    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.phase("tree_build"):
            original = self.options.rule == "original"
            draft = self.index.continuation(self.options.gamma, whole=original)
            for i, token in enumerate(draft if not original else ()):  # as transformers: never draft past an EOS
                if token in self.eos:
                    draft = draft[:i]
                    break
        self.drafted += len(draft)
        self.steps_with_draft += bool(draft)
        return DraftTree.chain(draft) if draft else DraftTree.empty()

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        self.index.extend(result.committed)

    def end(self, state: DecodeState) -> dict:
        return {"pld_drafted": self.drafted, "pld_steps_with_draft": self.steps_with_draft}
