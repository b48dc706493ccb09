"""SpS with Hugging Face assisted generation's adaptive draft length (PACER's "Assist" baseline).

Two heuristics on top of the SpS draft model, following the behaviour documented for
``transformers`` assisted generation (``num_assistant_tokens_schedule="heuristic"`` and
``assistant_confidence_threshold``):

* length schedule: after a verify call that accepted every draft, the next chain may be 2 tokens
  longer; otherwise it is 1 shorter (never below 1);
* confidence stop: drafting ends early after a token whose draft probability is below a
  threshold (that token is still proposed); the threshold is re-fitted after every verify call to
  the value that minimises FPR + 3·FNR over the (probability, accepted?) pairs seen so far, i.e. it
  prefers drafting a wasted token to stopping before an accepted one.

Both are reset at the start of every prompt turn (HF's "heuristic_transient"), so records do not
depend on prompt order. The stop rule reads only draft-side quantities, so the chain stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from methods.sps.drafter import SpSDrafter
from methods.weights_options import draft_model_weights
from specbench.engine.drafter import DecodeState, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option


@dataclass
class SpSConfidenceOptions(draft_model_weights("Draft model, as for sps.")):
    gamma: int = option(5, "Initial chain length (HF assisted generation's original num_assistant_tokens).", ge=1,
                        tokens=True)
    threshold: float = option(0.4, "Initial confidence threshold (HF's default assistant_confidence_threshold).",
                              ge=0, le=1)
    schedule: bool = option(True, "+2 after a fully accepted chain, -1 otherwise.")
    adapt_threshold: bool = option(True, "Re-fit the threshold from observed acceptances.")
    max_gamma: int = option(48, "Safety cap on the chain length.", ge=1, tokens=True)
    dtype: str = option("", "Draft dtype; empty = the target's.")

    def check(self, owner: str) -> None:
        if self.gamma > self.max_gamma:
            raise SpecbenchError(f"{owner}: need gamma <= max_gamma, got gamma={self.gamma}, max_gamma={self.max_gamma}")


def best_threshold(probs: list[float], matched: list[int]) -> float | None:
    """Threshold minimising FPR + 3·FNR when "prob >= threshold" predicts acceptance; None until
    there are more than 5 samples with both outcomes. Ties go to the highest threshold."""
    if len(probs) <= 5 or len(set(matched)) < 2:
        return None
    p = torch.tensor(probs, dtype=torch.float64)
    m = torch.tensor(matched, dtype=torch.bool)
    candidates = torch.cat([torch.tensor([float("inf")], dtype=torch.float64), p.unique().flip(0)])
    predicted = p.unsqueeze(0) >= candidates.unsqueeze(1)  # [thresholds, samples]
    fpr = (predicted & ~m).sum(1) / (~m).sum()
    fnr = (~predicted & m).sum(1) / m.sum()
    return float(candidates[int(torch.argmin(fpr + 3 * fnr))])


def next_gamma(gamma: int, accepted: int, drafted: int) -> int:
    """HF's heuristic schedule: grow by 2 when every draft was accepted, else shrink by 1 (>= 1)."""
    return gamma + 2 if accepted == drafted else max(1, gamma - 1)


class SpSConfidenceDrafter(SpSDrafter):
    name = "sps-confidence"
    label = "SpS (confidence stop)"
    family = "sps"
    Options = SpSConfidenceOptions

    def __init__(self, options: SpSConfidenceOptions | None = None, model=None, tokenizer=None) -> None:
        super().__init__(options, model, tokenizer)

    def begin(self, state: DecodeState, prefill) -> None:
        super().begin(state, prefill)
        self.gamma, self.threshold = self.options.gamma, self.options.threshold
        self.probs: list[float] = []  # draft probability of every drafted token up to its chain's first reject
        self.matched: list[int] = []
        self.chain_probs: list[float] = []
        self.lengths: list[int] = []
        self.early_stops = 0

    def _stop(self, drafts: list[int], logits: torch.Tensor, state: DecodeState) -> bool:
        # HF reads the probability of the token it just drafted (argmax at T = 0) under the draft softmax.
        confidence = float(torch.softmax(logits.float(), -1)[drafts[-1]])
        self.chain_probs.append(confidence)
        if len(drafts) >= min(self.gamma, self.options.max_gamma):
            return True
        if confidence < self.threshold:
            self.early_stops += 1
            return True
        return False

    def propose(self, state: DecodeState):
        self.chain_probs = []
        tree = super().propose(state)
        self.lengths.append(len(tree))
        return tree

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        accepted, drafted = len(result.accepted), len(result.tree)
        if self.options.schedule:
            self.gamma = next_gamma(self.gamma, accepted, drafted)
        if self.options.adapt_threshold:
            # Accepted drafts are positives, the first rejected one a negative; later ones were never judged.
            judged = min(drafted, accepted + 1)
            self.probs.extend(self.chain_probs[:judged])
            self.matched.extend([1] * accepted + [0] * (judged - accepted))
            fitted = best_threshold(self.probs, self.matched)
            if fitted is not None:
                self.threshold = fitted

    def end(self, state: DecodeState) -> dict:
        n = max(len(self.lengths), 1)
        return {"mean_gamma": sum(self.lengths) / n, "early_stops": self.early_stops,
                "final_threshold": self.threshold if self.threshold != float("inf") else None,
                "final_gamma": self.gamma}
