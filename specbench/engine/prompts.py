"""Rendering user turns into target token ids: the tokenizer's chat template (with optional
``apply_chat_template`` keyword arguments such as Qwen3's ``enable_thinking``), FastChat's
``vicuna_v1.1`` conversation for Vicuna targets (they ship no template), or a plain fallback."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from specbench.errors import SpecbenchError

# Used only when a tokenizer has no chat template (base models); stated in the run metadata.
FALLBACK_TEMPLATE = "{role}: {content}\n"
TEMPLATES = ("auto", "tokenizer", "vicuna_v1.1", "plain")
# FastChat conversation.py, "vicuna_v1.1": SeparatorStyle.ADD_COLON_TWO, roles USER/ASSISTANT,
# sep " " after the system message and user turns, sep2 "</s>" after assistant turns.
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")


@dataclass(frozen=True)
class ChatFormat:
    """How prompts are rendered: a template name and ``apply_chat_template`` keyword arguments."""

    template: str = "auto"
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise SpecbenchError(f"unknown --chat-template {self.template!r}; use one of {', '.join(TEMPLATES)}")
        clash = sorted(set(self.kwargs) & set(RESERVED_KWARGS))
        if clash:
            raise SpecbenchError(f"chat template kwargs {', '.join(clash)} are set by specbench itself; pass only the "
                                 "template's own variables, e.g. enable_thinking=false")

    def resolve(self, tokenizer, model_name: str = "") -> "ChatFormat":
        """``auto`` -> the tokenizer's template, else vicuna_v1.1 for Vicuna models, else plain."""
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.template == "tokenizer" and not has_template:
            raise SpecbenchError("--chat-template tokenizer: this target's tokenizer has no chat template; "
                                 "use auto, vicuna_v1.1 or plain")
        if self.template != "auto":
            chosen = self.template
        elif has_template:
            chosen = "tokenizer"
        else:
            chosen = "vicuna_v1.1" if "vicuna" in model_name.lower() else "plain"
        if self.kwargs and chosen != "tokenizer":
            raise SpecbenchError(f"--chat-template-kwargs apply to a tokenizer's chat template; the prompts render "
                                 f"with {chosen}")
        return ChatFormat(chosen, dict(self.kwargs))

    def check(self, tokenizer, system_prompt: str | None = None) -> "ChatFormat":
        """A resolved format that renders: a template that is not valid Jinja, or refuses a system prompt,
        fails here in one line (before any drafter loads) rather than at the first prompt."""
        if self.template == "tokenizer":
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            _apply_template(tokenizer, messages + [{"role": "user", "content": "Hi."}], dict(self.kwargs),
                            tokenize=False)
        return self

    def describe(self, tokenizer) -> dict:
        """What rendered the prompts, for the results header."""
        out = {"template": self.template, "kwargs": dict(self.kwargs)}
        if self.template == "tokenizer":
            text = tokenizer.chat_template
            text = text if isinstance(text, str) else repr(text)
            out["sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return out


# apply_chat_template arguments that render_chat sets, or that change what it returns (text, a dict,
# tensors, a cut prompt): passed as template kwargs they would clash or break tokenisation.
RESERVED_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                   "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                   "tokenizer_kwargs", "chat_template", "tools", "documents")


def parse_template_kwargs(pairs: list[str]) -> dict:
    """``key=value`` strings -> kwargs; true/false become bools and integers ints."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecbenchError(f"--chat-template-kwargs expects key=value, got {pair!r} (e.g. enable_thinking=false)")
        if key.strip() in RESERVED_KWARGS:
            raise SpecbenchError(f"--chat-template-kwargs {key.strip()} is set by specbench itself (prompts are rendered "
                                 "as token ids with the assistant turn opened); pass only the template's own variables, "
                                 "e.g. enable_thinking=false")
        if not key.strip().isidentifier():
            raise SpecbenchError(f"--chat-template-kwargs key {key.strip()!r} is not a name a template can use; "
                                 "e.g. enable_thinking=false")
        value = value.strip()
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[key.strip()] = lowered == "true"
        else:
            try:
                out[key.strip()] = int(value)
            except ValueError:
                out[key.strip()] = value
    return out


def vicuna_v1_1(messages: list[dict]) -> str:
    """FastChat's vicuna_v1.1 prompt, assistant turn opened: 'SYSTEM USER: q ASSISTANT: a</s>USER: q ASSISTANT:'."""
    system = VICUNA_SYSTEM
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    seps = (" ", "</s>")
    text = system + seps[0]
    for i, m in enumerate(messages):
        role = "USER" if m["role"] == "user" else "ASSISTANT"
        text += f"{role}: {m['content']}{seps[i % 2]}"
    return text + "ASSISTANT:"


def render_chat(tokenizer, messages: list[dict], system_prompt: str | None = None,
                chat: ChatFormat | None = None) -> list[int]:
    """Token ids for ``messages`` with the assistant's turn opened (add_generation_prompt)."""
    if tokenizer is None:
        raise SpecbenchError("this target has no tokenizer; pass a model folder or hub id that includes one")
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + messages
    chat = (chat or ChatFormat()).resolve(tokenizer)
    if chat.template == "tokenizer":
        ids = _apply_template(tokenizer, messages, chat.kwargs, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]
    if chat.template == "vicuna_v1.1":  # FastChat tokenizes the prompt with the BOS token
        return tokenizer(vicuna_v1_1(messages), add_special_tokens=True)["input_ids"]
    text = "".join(FALLBACK_TEMPLATE.format(**m) for m in messages) + "assistant:"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def _apply_template(tokenizer, messages: list[dict], kwargs: dict, tokenize: bool):
    """The tokenizer's chat template applied; a template that is not valid Jinja, or that refuses these
    messages (``raise_exception``), is one line naming it."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, **kwargs)
    except TemplateError as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise SpecbenchError(f"the target's chat template (chat_template.jinja or tokenizer_config.json) cannot render "
                             f"the prompt ({why}); fix the template, or pass --chat-template plain") from None
