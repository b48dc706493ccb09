"""SpS against transformers' own assisted generation (``generate(assistant_model=...)``).

The assistant is our SpS draft model itself (the very module our drafter runs), set to draft
``gamma`` tokens per step on the "constant" schedule with the confidence threshold off, which is
the classic SpS chain. Our engine takes the first token from the prompt's prefill and drafts after
it; transformers' loop drafts straight after the prompt and merges the prefill into its first
verify. To compare step by step, the prompt's prefill runs first (one timed target forward giving
the first token) and ``generate`` continues from prompt + that token, so step k of both sides
drafts from the same prefix. Transformers' assisted loop cannot continue a pre-filled KV cache (it
feeds the whole input to its first verify), so its first verify re-reads the prompt; the timed
prefill forward of the same prompt is charged back from its decode time. Per-step accept lengths
come from a streamer: assisted generation puts each step's kept tokens (accepted drafts + bonus) in
one call.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from specbench import kvcache
from specbench.errors import SpecbenchError
from specbench.parity import ReferenceOutput, package_version, timed_call

# Our SpS ``schedule`` option -> transformers' num_assistant_tokens_schedule: "fixed" is the classic
# gamma-token chain; the heuristic ones are transformers' own +2/-1 rule (kept across prompts, or reset).
SCHEDULES = {"fixed": "constant", "heuristic": "heuristic", "heuristic_transient": "heuristic_transient"}


class StepLengths:
    """A transformers streamer that records how many tokens each put carried (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(int(value.reshape(-1).numel()))

    def end(self) -> None:
        pass

    @property
    def steps(self) -> list[int]:
        return self.puts[1:]


def prefill_first_token(target, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, int, float]:
    """One timed target forward over the prompt (last row's logits only, as a prefill computes) ->
    (ids [1, n], greedy first token, seconds)."""
    from transformers import DynamicCache

    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=target.device).reshape(1, -1)
    keep = {target._keep_kw: 1} if target._keep_kw else {}
    with torch.inference_mode():
        out, seconds = timed_call(target.device, target.model, input_ids=ids, use_cache=True,
                                  **kvcache.cache_arg(target.model, DynamicCache()), **keep)
    return ids, int(out.logits[0, -1].argmax()), seconds


def assisted_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, **assist) -> ReferenceOutput:
    """Greedy ``generate`` with ``assist`` (assistant_model=... or prompt_lookup_num_tokens=...) from the
    prompt + its prefill's first token; decode seconds = the ``generate`` call less the prefill it redoes."""
    from transformers import GenerationConfig

    ids, first, prefill_seconds = prefill_first_token(target, prompt_ids)
    eos = sorted(target.eos_token_ids)
    if first in eos or max_new_tokens <= 1:
        return ReferenceOutput([first], [], 0.0)
    full = torch.cat([ids, torch.tensor([[first]], device=ids.device)], 1)
    config = GenerationConfig(max_new_tokens=max_new_tokens - 1, do_sample=False, eos_token_id=eos or None,
                              pad_token_id=eos[0] if eos else None)
    streamer = StepLengths()
    with torch.inference_mode():
        out, seconds = timed_call(target.device, target.model.generate, full, attention_mask=torch.ones_like(full),
                                  generation_config=config, streamer=streamer, **assist)
    tokens = [first] + out[0, full.shape[1]:].tolist()
    return ReferenceOutput(tokens, [n - 1 for n in streamer.steps], max(seconds - prefill_seconds, 0.0))


class TransformersAssisted:
    name = "sps"
    reference = "transformers assisted generation"
    notes = ("transformers' generate(assistant_model=...) with our SpS draft model (the same module) drafting gamma "
             "tokens on the constant schedule (our schedule=heuristic[_transient]: transformers' own schedule of that name), confidence threshold off. generate continues from prompt + the "
             "prefill's first token, so both sides verify the same rows step by step; its assisted loop cannot "
             "continue a pre-filled KV cache and re-reads the prompt in its first verify, so the separately timed "
             "prefill of that prompt is subtracted from its decode time. By design transformers drafts fewer "
             "tokens when fewer remain in the budget (the last step only), and it runs its logits processors and "
             "stopping criteria on every step.")

    def version(self) -> str:
        return package_version("transformers")

    def load(self, target, drafter, options) -> None:
        model = getattr(drafter, "model", None)
        if model is None or not hasattr(model, "generate") or not hasattr(model, "generation_config"):
            raise SpecbenchError(f"{drafter.name}: transformers' assisted generation needs a transformers causal LM as "
                                 "the draft model; this drafter holds none")
        schedule = getattr(options, "schedule", "fixed") or "fixed"
        if schedule not in SCHEDULES:
            raise SpecbenchError(f"{drafter.name}: schedule={schedule!r} has no transformers counterpart "
                                 f"(known: {', '.join(SCHEDULES)})")
        config = copy.deepcopy(model.generation_config)  # transformers reads the assistant's settings from here
        config.num_assistant_tokens = int(options.gamma)
        config.num_assistant_tokens_schedule = SCHEDULES[schedule]
        config.assistant_confidence_threshold = 0.0  # off: a fixed-length chain, as SpS drafts
        config.do_sample = False
        model.generation_config = config
        self.target, self.assistant = target, model

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        return assisted_generate(self.target, prompt_ids, max_new_tokens, assistant_model=self.assistant)
