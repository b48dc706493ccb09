"""Rendering user turns into target token ids through the target's chat template."""

from __future__ import annotations

from specbench.errors import SpecbenchError

# Used only when a tokenizer has no chat template (base models); stated in the run metadata.
FALLBACK_TEMPLATE = "{role}: {content}\n"


def render_chat(tokenizer, messages: list[dict], system_prompt: str | None = None) -> list[int]:
    """Token ids for ``messages`` with the assistant's turn opened (add_generation_prompt)."""
    if tokenizer is None:
        raise SpecbenchError("this target has no tokenizer; pass a model folder or hub id that includes one")
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]
    text = "".join(FALLBACK_TEMPLATE.format(**m) for m in messages) + "assistant:"
    return tokenizer(text, add_special_tokens=True)["input_ids"]
