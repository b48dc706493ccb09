"""What fits the target's context: the refusals a run can make only once the target is loaded (its context
length), kept out of the runner, which asks and then loads, decodes and stores.

Torch-free: token counts in; a one-line ``SpecbenchError``, or the line a skipped turn prints, out. Every turn
needs its prompt, --max-new-tokens and ``TREE_SLACK`` rows for a draft tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from specbench.errors import SpecbenchError
from specbench.options import check_context

TREE_SLACK = 128  # room for a draft tree past max_new_tokens when checking the context window


@dataclass(frozen=True)
class ContextFit:
    context: int  # the loaded target's
    max_new_tokens: int
    on_long_prompt: str = "fail"  # fail | skip

    def need(self, prompt_tokens: int) -> int:
        """Context a turn of ``prompt_tokens`` needs: the prompt, --max-new-tokens and room for a draft tree."""
        return prompt_tokens + self.max_new_tokens + TREE_SLACK

    def check_answerable(self, sides: Iterable[tuple[str, Any]]) -> None:
        """--max-new-tokens, and every side's chain lengths and tree budgets (``(label, options)``), against the
        context, before any drafter's weights load."""
        if self.max_new_tokens + 1 > self.context:  # no prompt, however short, could be answered
            raise SpecbenchError(f"--max-new-tokens {self.max_new_tokens} does not fit the target's context of "
                                 f"{self.context} tokens with any prompt; pass a smaller --max-new-tokens")
        for label, options in sides:
            check_context(options, label, self.context, self.max_new_tokens)

    def turn(self, prompt_tokens: int, where: str) -> str | None:
        """None when a turn of ``prompt_tokens`` fits; else, under --on-long-prompt skip, the line its skip prints
        (under fail: refused)."""
        if self.need(prompt_tokens) <= self.context:
            return None
        if prompt_tokens + 1 + TREE_SLACK > self.context:  # no --max-new-tokens could help
            msg = (f"prompt {where} alone is {prompt_tokens} tokens (+ {TREE_SLACK} tree slack) and the target's "
                   f"context is {self.context}: no --max-new-tokens fits it")
            fix = "pass --on-long-prompt skip or a target with a longer context"
        else:
            msg = (f"prompt {where} needs {self.need(prompt_tokens)} tokens (prompt {prompt_tokens} + --max-new-tokens "
                   f"{self.max_new_tokens} + {TREE_SLACK} tree slack) but the target's context is {self.context}")
            fix = f"pass --on-long-prompt skip or --max-new-tokens {self.context - prompt_tokens - TREE_SLACK} or less"
        if self.on_long_prompt == "fail":
            raise SpecbenchError(f"{msg}; {fix}")
        return f"skipped: {msg}"

    def check_some_prompt_fits(self, first_turns: Iterable[int], bench: str) -> None:
        """Under --on-long-prompt skip, a run whose every prompt (``first_turns``: their first turns' token counts,
        read lazily) is past the context would write a file of no records: refused before anything is generated."""
        if self.on_long_prompt != "skip":
            return
        shortest = None
        for tokens in first_turns:
            if self.need(tokens) <= self.context:
                return
            shortest = tokens if shortest is None else min(shortest, tokens)
        if shortest is None:
            return
        room = self.context - shortest - TREE_SLACK
        fix = f"pass --max-new-tokens {room} or less" if room >= 1 else "pick a target with a longer context"
        raise SpecbenchError(f"every prompt of {bench} is past the target's context of {self.context} tokens (the "
                             f"shortest is {shortest} tokens, + --max-new-tokens {self.max_new_tokens} + "
                             f"{TREE_SLACK} tree slack), so nothing would be recorded; {fix}")
