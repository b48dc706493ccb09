"""PLD against transformers' own prompt lookup (``generate(prompt_lookup_num_tokens=...)``), with the
same settings: ``gamma`` -> prompt_lookup_num_tokens, ``ngram`` -> max_matching_ngram_size. It runs
through the same harness as SpS's reference (methods/parity/sps.py): our prefill gives the KV cache and
the first token, and ``generate`` continues from prompt + that token, so both sides look up the same text
at every step (without it transformers' first lookup would not see the first token)."""

from __future__ import annotations

from typing import Sequence

from methods.parity.sps import assisted_generate
from specbench.run.parity import ReferenceOutput, package_version


class TransformersPromptLookup:
    name = "pld"
    reference = "transformers prompt lookup"
    notes = ("transformers' generate(prompt_lookup_num_tokens=gamma, max_matching_ngram_size=ngram) continuing from "
             "the KV cache of our prefill, prompt + its first token (so both sides look up the same text at every "
             "step; a forward pre-hook hands its first verify only the rows the cache lacks). By design it drafts fewer tokens when fewer remain in the budget.")

    def version(self) -> str:
        return package_version("transformers")

    def load(self, target, drafter, options) -> None:
        self.target, self.gamma, self.ngram = target, int(options.gamma), int(options.ngram)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        return assisted_generate(self.target, prompt_ids, max_new_tokens, prompt_lookup_num_tokens=self.gamma,
                                 max_matching_ngram_size=self.ngram)
