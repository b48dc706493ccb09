"""SpS against transformers' own assisted generation (``generate(assistant_model=...)``).

The assistant is our SpS draft model itself (the very module our drafter runs), set to draft
``gamma`` tokens per step on the "constant" schedule with the confidence threshold off, which is
the classic SpS chain. Our engine takes the first token from the prompt's prefill and drafts after
it; transformers' loop drafts straight after the prompt and merges the prefill into its first
verify. To compare step by step, the prompt's prefill runs first (one target forward into a KV
cache, as our engine's, giving the first token) and ``generate`` continues that cache from prompt +
that token, so step k of both sides drafts from the same prefix and verifies the same rows.
Transformers' assisted loop does not slice a pre-filled cache off its first verify's input (plain
``generate`` does), so a forward pre-hook (``continue_cache``) hands the model only the new rows.
Per-step accept lengths come from a streamer: assisted generation puts each step's kept tokens
(accepted drafts + bonus) in one call.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Sequence

import torch

from specbench.engine import kvcache
from specbench.errors import SpecbenchError
from specbench.run.parity import ReferenceOutput, package_version, timed_call

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


def prefill(target, prompt_ids: Sequence[int]):
    """The prompt's prefill, as our engine's: one target forward into a fresh cache (last row's logits)
    -> (ids [1, n], cache, greedy first token)."""
    from transformers import DynamicCache

    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=target.device).reshape(1, -1)
    cache = DynamicCache()
    keep = {target._keep_kw: 1} if target._keep_kw else {}
    with torch.inference_mode():
        out = target.model(input_ids=ids, use_cache=True, **kvcache.cache_arg(target.model, cache), **keep)
    return ids, cache, int(out.logits[0, -1].argmax())


SEQUENCE_KWARGS = ("position_ids", "cache_position", "token_type_ids")


@contextmanager
def continue_cache(model, cache):
    """Make transformers' assisted loop continue a pre-filled cache. Its first verify feeds the whole
    sequence (it bypasses the prefill step that slices off what the cache holds), which would write the
    prompt into the cache a second time; this pre-hook hands the model only the rows the cache lacks
    (and their positions), as a plain ``generate`` does. Later calls are left alone."""

    def only_new_rows(module, args, kwargs):
        ids, held = kwargs.get("input_ids"), cache.get_seq_length()
        if ids is None or held == 0 or ids.shape[1] <= held or module.__dict__.get("_parity_done"):
            return None
        module.__dict__["_parity_done"] = True
        width = ids.shape[1]
        kwargs = dict(kwargs, input_ids=ids[:, held:])
        for key in SEQUENCE_KWARGS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.shape[-1] == width:
                kwargs[key] = value[..., held:]
        return args, kwargs

    handle = model.register_forward_pre_hook(only_new_rows, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        model.__dict__.pop("_parity_done", None)


def assisted_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, **assist) -> ReferenceOutput:
    """Greedy ``generate`` with ``assist`` (assistant_model=... or prompt_lookup_num_tokens=...) continuing
    our prefill of the prompt (its KV cache, and its greedy first token appended); decode seconds = the
    ``generate`` call."""
    from transformers import GenerationConfig

    ids, cache, first = prefill(target, prompt_ids)
    eos = sorted(target.eos_token_ids)
    if first in eos or max_new_tokens <= 1:
        return ReferenceOutput([first], [], 0.0)
    full = torch.cat([ids, torch.tensor([[first]], device=ids.device)], 1)
    config = GenerationConfig(max_new_tokens=max_new_tokens - 1, do_sample=False, eos_token_id=eos or None,
                              pad_token_id=eos[0] if eos else None)
    streamer = StepLengths()
    cache_kw = kvcache.cache_keyword(type(target.model).forward)
    with torch.inference_mode(), continue_cache(target.model, cache):
        out, seconds = timed_call(target.device, target.model.generate, full, attention_mask=torch.ones_like(full),
                                  generation_config=config, streamer=streamer, **{cache_kw: cache}, **assist)
    tokens = [first] + out[0, full.shape[1]:].tolist()
    return ReferenceOutput(tokens, [n - 1 for n in streamer.steps], seconds)


class TransformersAssisted:
    name = "sps"
    reference = "transformers assisted generation"
    notes = ("transformers' generate(assistant_model=...) with our SpS draft model (the same module) drafting gamma "
             "tokens on the constant schedule (our schedule=heuristic[_transient]: transformers' own schedule of that name), confidence threshold off. generate continues the KV cache of our prefill from prompt + its first token, so both sides verify the same rows step by step (a forward pre-hook hands its first verify only the rows the cache lacks: its assisted loop does not slice a pre-filled cache the way plain generate does). By design transformers drafts fewer "
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
