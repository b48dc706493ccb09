"""SpS: classic speculative sampling with a smaller draft model sharing the target's tokenizer.

The draft model keeps its own KV cache over the committed prefix; each call feeds the committed
tokens it has not seen, drafts a chain of ``gamma`` tokens (argmax at T = 0, else sampled from
the draft distribution, whose rows go into the tree as q), and the engine verifies the chain with
rejection sampling against the residual (rule C with one child per node).

``schedule`` picks the chain length per step: ``fixed`` (gamma every step), or transformers'
assisted-generation schedule (``num_assistant_tokens_schedule``; Spec-Bench's SpS row): start at
gamma (transformers' 5), +2 after a chain the target accepted whole, -1 otherwise (never below 1).
``heuristic`` carries the length from one turn to the next, as transformers keeps it on the
assistant model between generate calls (so the drafter's state follows the query order);
``heuristic_transient`` resets it to gamma every turn.

In a batch (``--batch-size``) SpS with the fixed schedule drafts every request's chain together: one
draft-model forward per chain position over a ragged draft cache (one row per request, its own
length; ``engine/batch_cache.py``). A request's draft model reads its prompt when it joins (timed with
its prefill; alone, SpS feeds the prompt in its first propose, timed as drafting). Subclasses and the
adaptive schedules, whose chain lengths are per request, draft through the per-request default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from specbench.engine import kvcache
from specbench.engine.batch_cache import RaggedCache
from specbench.engine.draft_model import DraftLM
from specbench.engine.batch_target import forward_rows, pack_rows
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target, load_located, locate_model, resolve_dtype
from specbench.training.checkpoint import read_drafter_config
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import draw, logits_to_probs
from methods.checkpoints import shipped_drafter
from methods.sps.student import is_student, load_student
from methods.weights_options import draft_model_weights

# Draft models shipped with the project, per embedded target name.


@dataclass
class SpSOptions(draft_model_weights(
        "Draft model: a folder, .gguf file or hub id org/name[@rev]; truncated:N = the target's first N layers "
        "(untrained, weak: a starting point for distillation; N = all of them: a copy of the target); empty = the "
        "shipped one for the target.")):
    gamma: int = option(5, "Chain length: tokens drafted per verify call.", ge=1, tokens=True)
    dtype: str = option("", "Draft dtype; empty = the target's.")
    draft_temperature: float = option(
        0.0, "Temperature of the draft's sampled chain (its q) when the run samples; 0 = the run's. Any q keeps "
             "SpS lossless: it changes only how often drafts are accepted.", ge=0)
    schedule: Literal["fixed", "heuristic", "heuristic_transient"] = option(
        "fixed", "Chain length per step: fixed = gamma; heuristic = transformers' assisted generation (start at gamma, "
                 "+2 after a chain accepted whole, -1 otherwise, carried across turns); heuristic_transient = the "
                 "same, reset every turn.")


def next_length(length: int, accepted: int, drafted: int) -> int:
    """transformers' heuristic: 2 longer after a chain accepted whole, else 1 shorter (never below 1)."""
    return length + 2 if accepted == drafted else max(1, length - 1)


def check_same_vocabulary(target_tok, draft_tok, target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    """Refuse a draft model whose token ids do not mean the same as the target's."""
    if target_tok is not None and draft_tok is not None:
        if target_tok.get_vocab() != draft_tok.get_vocab():
            raise SpecbenchError(f"draft model {draft_name!r} has a different vocabulary from the target; "
                                 "SpS needs a draft model with the same tokenizer")
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            t, d = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
            if t is not None and d is not None and t != d:
                raise SpecbenchError(f"draft model {draft_name!r} has {attr}={d} but the target has {t}; "
                                     "SpS needs identical special tokens")
    elif draft_vocab < target_vocab:
        raise SpecbenchError(f"draft model {draft_name!r} has {draft_vocab} output rows, fewer than the target's "
                             f"{target_vocab}; SpS needs the same vocabulary")


def truncated_copy(target: Target, spec: str):
    """A draft model made of the target's first N decoder layers, its final norm and lm_head."""
    import copy

    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise SpecbenchError(f"sps: draft={spec!r} must be truncated:N with an integer N") from None
    if not 1 <= n <= target.num_layers:
        raise SpecbenchError(f"sps: truncated:N needs 1 <= N <= {target.num_layers} (the target's layers)")
    model = copy.deepcopy(target.model)
    model.model.layers = model.model.layers[:n]
    model.config.num_hidden_layers = n
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n]
    return model


class SpSDrafter(Drafter):
    name = "sps"
    label = "SpS"
    Options = SpSOptions
    weight_options = ("draft",)
    trainer = "methods.sps.student:StudentTrainer"  # `specbench train sps-student`: a distilled draft model

    @classmethod
    def builtin_reference(cls, spec: str) -> bool:
        from specbench.engine.target import named_model

        return spec.startswith("truncated:") or named_model(spec)

    def __init__(self, options: SpSOptions | None = None, model=None, tokenizer=None) -> None:
        super().__init__(options)  # the options' declaration refuses a schedule outside its Literal
        self.model, self.tokenizer = model, tokenizer
        self.length = getattr(self.options, "gamma", 1)  # the chain length of the next step
        if self.schedule == "heuristic":
            self.learns = True  # the length carries over between queries: their order is part of the run

    @property
    def schedule(self) -> str:
        """This side's length schedule; subclasses whose options have no (string) schedule draft as fixed."""
        value = getattr(self.options, "schedule", "fixed")
        return value if isinstance(value, str) else "fixed"

    def setup(self, target: Target) -> None:
        super().setup(target)
        if self.model is None and self.options.draft.startswith("truncated:"):
            self.model, self.tokenizer = truncated_copy(target, self.options.draft), target.tokenizer
        elif self.model is None:
            shipped = shipped_drafter(target.name, "sps")
            spec = self.options.draft or str(shipped)
            if not self.options.draft and not shipped.exists():
                raise SpecbenchError(f"sps needs a draft model for target {target.name!r}; pass --opt draft=PATH_OR_HUB_ID "
                                     "(same tokenizer as the target)")
            dtype = resolve_dtype(self.options.dtype or target.dtype)
            source = locate_model(spec, getattr(self.options, "revision", "") or None, f"{self.name} draft")
            self.sources["draft"] = source
            if (source.path / "config.json").is_file() and is_student(read_drafter_config(source.path)):
                self.model, self.tokenizer = load_student(source.path, target, dtype), target.tokenizer
            else:
                self.model, self.tokenizer, _ = load_located(source, dtype, str(target.device),
                                                             target.attn_implementation, what="--opt draft")
        self.model.eval()
        draft_vocab = self.model.get_output_embeddings().weight.shape[0]
        check_same_vocabulary(target.tokenizer, self.tokenizer, target.vocab_size, draft_vocab,
                              self.options.draft or "draft")
        self.vocab = target.vocab_size  # draft rows beyond the target's vocabulary are padding
        self.device = next(self.model.parameters()).device
        # the draft model runs in the target's engine (compiled: a static cache and graphs, as the target's)
        context = min(getattr(self.model.config, "max_position_embeddings", None) or target.max_context,
                      target.max_context)
        self.lm = DraftLM(self.model, getattr(target, "engine", "eager"), context)

    def begin(self, state: DecodeState, prefill) -> None:
        self.lm = self.lm.fresh()
        self.cached: list[int] = []  # token ids whose keys/values are in the draft model's cache
        if self.schedule != "heuristic":
            self.length = getattr(self.options, "gamma", 1)
        self.step_lengths: list[int] = []  # chain length of every step, for the record

    def _run(self, ids: list[int], start: int, state: DecodeState) -> torch.Tensor:
        """One draft-model forward over ``ids`` at positions start.. (appends to the draft cache); the last one's
        logits [1, V]."""
        with state.timer.forward("drafter"):
            return self.lm.forward(ids, start, timer=state.timer)[0]

    def _logits(self, ids: list[int], start: int, state: DecodeState) -> torch.Tensor:
        return self._run(ids, start, state)[-1, : self.vocab]

    def _sync(self, committed: list[int]) -> tuple[list[int], int]:
        """Crop the draft cache to the longest cached prefix that is still committed; return the
        committed tokens to feed and their first position (always >= 1 token, so there are logits)."""
        keep = 0
        limit = min(len(self.cached), len(committed) - 1)
        while keep < limit and self.cached[keep] == committed[keep]:
            keep += 1
        self.lm.truncate(keep)
        return committed[keep:], keep

    def _pick(self, logits: torch.Tensor, state: DecodeState) -> tuple[int, torch.Tensor | None]:
        """The next draft token and, when sampled, the distribution q it was drawn from."""
        if state.params.greedy:
            return int(logits.argmax()), None
        params = state.params
        if getattr(self.options, "draft_temperature", 0.0):  # the run's filters, at the draft's own temperature
            params = dataclasses.replace(params, temperature=self.options.draft_temperature)
        q = logits_to_probs(logits.unsqueeze(0), params)[0]
        return draw(q, state.generator), q

    def _stop(self, drafts: list[int], logits: torch.Tensor, state: DecodeState) -> bool:
        """Whether the chain ends after ``drafts`` (SpS: a fixed length; subclasses adapt it)."""
        return len(drafts) >= (self.length if self.schedule != "fixed" else self.options.gamma)

    def propose(self, state: DecodeState) -> DraftTree:
        committed = state.tokens
        feed, start = self._sync(committed)
        drafts, qs = [], []
        while True:
            logits = self._logits(feed, start, state)
            token, q = self._pick(logits, state)
            start += len(feed)
            drafts.append(token)
            qs.append(q)
            feed = [token]
            if self._stop(drafts, logits, state):
                break
        self.cached = committed + drafts[:-1]
        if not state.params.greedy:
            return DraftTree.chain(drafts, q=torch.stack(qs), kind=SiblingKind.SAMPLED_IID)
        return DraftTree.chain(drafts)

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        # The cache is cropped lazily to the committed prefix at the next propose.
        if self.schedule != "fixed":
            self.step_lengths.append(len(result.tree))
            self.length = next_length(self.length, len(result.accepted), len(result.tree))

    def end(self, state: DecodeState) -> dict:
        if self.schedule == "fixed":
            return {}
        return {"mean_gamma": sum(self.step_lengths) / max(len(self.step_lengths), 1), "next_gamma": self.length}

    # ---- batches: every request's chain in one draft forward per position ----------------------
    @property
    def batched_drafting(self) -> bool:
        return type(self) is SpSDrafter and self.schedule == "fixed"

    def begin_batch(self, states, prefills) -> None:
        from transformers import DynamicCache

        if not self.batched_drafting:
            return super().begin_batch(states, prefills)
        if not getattr(self, "rows", None):  # a batch that emptied starts a fresh draft cache
            self.rows, self.row_tokens = RaggedCache(), []
        for state in states:  # the draft model reads each joining prompt (the bonus is fed at its first propose)
            prompt = state.tokens[: state.prompt_len]
            one = DynamicCache()
            with torch.inference_mode(), state.timer.forward("drafter"):
                self.model(input_ids=torch.tensor([prompt], device=self.device), use_cache=True,
                           **kvcache.cache_arg(self.model, one))
            self.rows.add(one, len(prompt))
            self.row_tokens.append(list(prompt))

    def propose_batch(self, states) -> list[DraftTree]:
        if not self.batched_drafting:
            return super().propose_batch(states)
        feeds = []
        for b, state in enumerate(states):  # _sync per row: keep the longest cached prefix still committed
            keep, cached = 0, self.row_tokens[b]
            limit = min(len(cached), len(state.tokens) - 1)
            while keep < limit and cached[keep] == state.tokens[keep]:
                keep += 1
            self.rows.truncate(b, keep)
            feeds.append(state.tokens[keep:])
        drafts: list[list[int]] = [[] for _ in states]
        qs: list[list[torch.Tensor]] = [[] for _ in states]
        greedy = [state.params.greedy for state in states]
        for _ in range(self.options.gamma):
            logits = self._ragged_logits(feeds, states[0].timer)
            picks = logits.argmax(-1).tolist() if any(greedy) else None  # one read-back for the greedy rows
            for b, state in enumerate(states):
                token, q = (picks[b], None) if greedy[b] else self._pick(logits[b], state)
                drafts[b].append(token)
                qs[b].append(q)
            feeds = [[chain[-1]] for chain in drafts]
        self.row_tokens = [state.tokens + chain[:-1] for state, chain in zip(states, drafts)]
        return [DraftTree.chain(chain) if exact else
                DraftTree.chain(chain, q=torch.stack(q), kind=SiblingKind.SAMPLED_IID)
                for chain, q, exact in zip(drafts, qs, greedy)]

    def _ragged_logits(self, feeds: list[list[int]], timer) -> torch.Tensor:
        """One draft forward over every row's feed (appended to its cached prefix); [B, V] at each last token."""
        dtype = next(self.model.parameters()).dtype
        packed = pack_rows([(feed, range(-1, len(feed) - 2)) for feed in feeds], self.rows, self.device, dtype)
        out = forward_rows(self.model, self.rows, packed, timer=timer, owner="drafter")
        self.rows.commit(packed.width, [range(len(feed)) for feed in feeds])
        last = torch.tensor([len(feed) - 1 for feed in feeds], device=out.logits.device)
        return out.logits[torch.arange(len(feeds), device=last.device), last, : self.vocab]

    def observe_batch(self, states, results) -> None:
        if not self.batched_drafting:
            super().observe_batch(states, results)  # the fixed schedule learns nothing from a verify

    def end_batch(self, rows, states) -> list[dict]:
        if not self.batched_drafting:
            return super().end_batch(rows, states)
        self.rows.remove(rows)
        self.row_tokens = [t for b, t in enumerate(self.row_tokens) if b not in set(rows)]
        return [{} for _ in rows]
