"""EAGLE-3: a one-layer drafter in the target's feature space that grows a dynamic top-k tree.

Step 0 fuses three target taps (low/mid/high layers, ``fc``: 3H -> H) with the embedding of the
*next* token (EAGLE alignment: features of position j pair with token j+1); later steps feed the
drafter's own output hidden state back in. Each propose call:

1. encodes the committed positions it has not seen (a stable KV cache over committed positions);
2. runs ``depth`` batched forwards over a frontier of ``top_k`` nodes (tree attention over the
   stable cache and each node's ancestors), keeping every one of the top_k x top_k candidates and
   the global top_k by cumulative log-probability as the next frontier;
3. keeps the best ``total_tokens - 1`` candidates by score, ancestor-closed (docs/methods.md#eagle-3).

In a batch (``--batch-size``) the same three steps run for every request at once: one drafter forward
encodes every request's new committed positions (a ragged stable cache, one row per request), then
each of the ``depth`` expansions is one forward over all B frontiers; the trees stay per request.

Training unrolls the same recurrence (the "training-time test"): step s sees the step-0 keys up to
its index plus its own keys of steps 1..s, exactly what a depth-(s+1) tree node sees.

Checkpoints: our folder format (``specbench.training.checkpoint``) or the official EAGLE-3 layout
(``config.json`` + ``pytorch_model.bin`` / ``model.safetensors``). Module names follow the
official key names, so both formats share one state-dict layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from methods.checkpoints import check_layer_shapes, load_checked, load_ours_or_published, save_ours, shipped_drafter
from methods.checkpoints import read_published_weights  # whole or sharded weights
from methods.eagle3.compiled_head import CompiledHead, log_probs
from methods.layers import (KV, DecoderLayer, LayerShapes, RMSNorm, Rotary, official_layer_shapes, repeat_kv,
                            target_layer_shapes)
from methods.speculators_layout import is_speculators, speculators_eagle3, speculators_keys
from methods.taps import check_taps, eagle3_taps
from methods.tree_select import candidates_to_tree, select_nodes
from methods.weights_options import drafter_weights
from specbench.engine.batch_cache import RaggedKV
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target, TargetOutput
from specbench.training.batch import TrainBatch
from specbench.training.checkpoint import CONFIG, architecture, config_value
from specbench.engine.tree import DraftTree, SiblingKind

# The official loader (SafeAILab/EAGLE ea_model.py) tries pytorch_model.bin first, then model.safetensors.
OFFICIAL_WEIGHTS = ("pytorch_model.bin", "model.safetensors")
# Official keys we deliberately drop: the embedding is the target's; inv_freq is derived from config.
OFFICIAL_IGNORED = ("embed_tokens.weight", "*rotary_emb.inv_freq")


# ---- architecture ----------------------------------------------------------------------------
@dataclass
class Eagle3Config(LayerShapes):
    draft_vocab_size: int
    # Published variants (SpecForge LlamaForCausalLMEagle3): taps of a wider/narrower target (fc reads
    # taps x target_hidden_size; 0 = hidden_size), an RMSNorm per tap before fc, no norm before lm_head.
    target_hidden_size: int = 0
    fc_norm: bool = False
    norm_output: bool = True

    @property
    def tap_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_target(cls, target: Target, draft_vocab: int) -> "Eagle3Config":
        return cls(**target_layer_shapes(target), draft_vocab_size=draft_vocab)

    @classmethod
    def from_official(cls, raw: dict, source: str) -> "Eagle3Config":
        """From an official EAGLE-3 ``config.json`` (Llama-style keys, optional ``draft_vocab_size``,
        ``target_hidden_size``, ``fc_norm``, ``norm_output``)."""
        tapped = raw.get("target_hidden_size") or 0
        shapes = official_layer_shapes(raw, source, "EAGLE-3")
        return cls(**shapes, draft_vocab_size=raw.get("draft_vocab_size") or shapes["vocab_size"],
                   target_hidden_size=0 if tapped == raw.get("hidden_size") else int(tapped),
                   fc_norm=bool(raw.get("fc_norm", False)), norm_output=bool(raw.get("norm_output", True)))


def _unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        groups: int) -> torch.Tensor:
    """Training-time-test attention for step s = len(keys) - 1: index j attends causally to the
    step-0 keys and to its own keys of steps 1..s (the drafted ancestors of a depth-(s+1) node)."""
    scale = q.shape[-1] ** -0.5
    n = q.shape[2]
    k0, v0 = repeat_kv(keys[0], groups), repeat_kv(values[0], groups)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * repeat_kv(k, groups)).sum(-1, keepdim=True) * scale for k in keys[1:]]
    weights = torch.cat(scores, -1).float().softmax(-1).to(q.dtype)
    out = weights[..., :n] @ v0
    for t, v in enumerate(values[1:]):
        out = out + weights[..., n + t: n + t + 1] * repeat_kv(v, groups)
    return out


class Eagle3Model(nn.Module):
    """fc (3H -> H) + one decoder layer + final norm + lm_head over the draft vocabulary.

    ``d2t`` [draft V] maps draft ids to target ids (target = draft + d2t[draft]); ``t2d`` [V] marks
    target ids inside the draft vocabulary. The token embedding is the target's, frozen and only
    referenced (not a submodule), so it is neither trained nor saved; a published drafter narrower
    or wider than its target brings its own (``own_embedding``, frozen, key ``embed_tokens.weight``)."""

    def __init__(self, config: Eagle3Config, taps: Sequence[int], embedding: nn.Module | None = None,
                 own_embedding: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.taps = tuple(taps)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.taps) * config.tap_size, h, bias=False)
        if config.fc_norm:  # SpecForge: RMSNorm each tap before fc
            self.fc_norm = nn.ModuleList(RMSNorm(config.tap_size, config.rms_norm_eps) for _ in self.taps)
        if own_embedding is not None:
            self.embed_tokens = nn.Embedding.from_pretrained(own_embedding, freeze=True)
        self.midlayer = DecoderLayer(config, fused_input=True)  # q/k/v read [embedding; hidden] (2H)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.rotary = Rotary(config)
        self._embedding: tuple[nn.Module, ...] = ()
        if embedding is not None:
            self.attach_embedding(embedding)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: Target, vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> "Eagle3Model":
        """A fresh drafter for ``target``; ``vocab`` = (d2t, t2d) from ``specbench.training.vocab.build_vocab_mapping``
        (default: the full target vocabulary)."""
        draft_vocab = target.vocab_size if vocab is None else int(vocab[0].numel())
        model = cls(Eagle3Config.from_target(target, draft_vocab), eagle3_taps(target.num_layers),
                    target.model.get_input_embeddings())
        if vocab is not None:
            model.d2t.copy_(vocab[0])
            model.t2d.copy_(vocab[1])
        return model.to(target.device)

    def attach_embedding(self, embedding: nn.Module) -> None:
        self._embedding = (embedding,)  # a tuple keeps it out of parameters() and state_dict()

    @property
    def trainable(self) -> set[str]:
        """Names of the trained parameters: all but a drafter-owned frozen embedding."""
        return {name for name, _ in self.named_parameters() if not name.startswith("embed_tokens.")}

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---- building blocks ----------------------------------------------------------------
    def embed(self, target_ids: torch.Tensor) -> torch.Tensor:
        embedding = getattr(self, "embed_tokens", None) or (self._embedding[0] if self._embedding else None)
        if embedding is None:
            raise RuntimeError("Eagle3Model has no token embedding; call attach_embedding(target embedding)")
        with torch.no_grad():
            return embedding(target_ids).to(self.dtype)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target taps (3 x tap size) go through fc; the drafter's own output (H) is already fused."""
        hidden = hidden.to(self.dtype)
        if hidden.shape[-1] != self.fc.in_features:
            return hidden
        if self.config.fc_norm:
            hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, hidden.chunk(len(self.taps), -1))], -1)
        return self.fc(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden) if self.config.norm_output else hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def features(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([taps[i] for i in self.taps], -1)

    def _project(self, hidden: torch.Tensor, target_ids: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, N, d] and rotated k, v [B, kv_heads, N, d] of the pairs (hidden, token)."""
        attn = self.midlayer.self_attn
        x = self.midlayer.attention_input(hidden, self.embed(target_ids))
        return (attn.queries(x, cos, sin), *attn.keys_values(x, cos, sin))

    # ---- inference ----------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, target_ids: torch.Tensor, positions: torch.Tensor,
                past: KV | None = None, visible: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """One pass over N new rows.

        hidden [B, N, 3H] (target taps) or [B, N, H] (own output); target_ids, positions [B, N];
        past: cached keys/values [B, kv_heads, S, d]; visible [N, S + N] bool (True = attend),
        default causal. Returns the un-normalised output [B, N, H] and the keys/values of past + new
        rows (the extended cache)."""
        hidden = self.fuse(hidden)
        cos, sin = self.rotary(positions, hidden.dtype)
        q, k, v = self._project(hidden, target_ids, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if visible is None:
            s, n = keys.shape[2] - k.shape[2], k.shape[2]
            visible = torch.arange(s + n, device=k.device)[None] <= (s + torch.arange(n, device=k.device))[:, None]
        attn = self.midlayer.self_attn
        return self.midlayer.finish(hidden, attn.output(attn.attend(q, keys, values, visible))), (keys, values)

    # ---- training -----------------------------------------------------------------------
    def unroll(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
        """Yield the output hidden [B, T, H] of steps 0..steps-1. At step s index j reads token
        x_{j+1+s} at position j+s (ids past the end are padding, masked by the loss)."""
        b, n = input_ids.shape
        hidden = self.fuse(features)
        positions = torch.arange(n, device=input_ids.device).expand(b, n)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for s in range(steps):
            tokens = F.pad(input_ids[:, 1 + s:], (0, min(1 + s, n)))
            cos, sin = self.rotary(positions + s, hidden.dtype)
            q, k, v = self._project(hidden, tokens, cos, sin)
            keys.append(k)
            values.append(v)
            attn = self.midlayer.self_attn
            hidden = self.midlayer.finish(hidden, attn.output(_unrolled_attention(q, keys, values, attn.groups)))
            yield hidden

    def training_loss(self, batch: TrainBatch, steps: int = 7, decay: float = 0.8) -> tuple[torch.Tensor, dict]:
        """Training-time test (docs/methods.md#eagle-3-training): sum_s decay^s * soft CE of step s.

        Index j at step s predicts x_{j+2+s} against p* = softmax of the target logits at j+1+s
        restricted to the draft vocabulary. A position counts iff that predicted token is a real
        response token (loss_mask, attention_mask) and the target's argmax lies in the draft vocab.
        Returns (loss, {"loss", "acc_1".."acc_steps"}), acc = top-1 agreement with the target."""
        in_vocab, restricted = batch.draft_vocab_targets(self.t2d)
        # p* and its argmax once for all unroll steps (each step reads a shifted slice of them).
        p_all, top_all = restricted.softmax(-1), restricted.argmax(-1)
        wanted = (batch.loss_mask > 0) & (batch.attention_mask > 0)
        features = self.features(batch.taps)
        total = torch.zeros((), device=features.device)
        metrics: dict[str, float] = {}
        for s, hidden in enumerate(self.unroll(batch.input_ids, features, steps)):
            n = batch.input_ids.shape[1] - 2 - s  # indices j whose predicted token x_{j+2+s} exists
            if n <= 0:
                metrics[f"acc_{s + 1}"] = 0.0
                continue
            p_star = p_all[:, 1 + s: 1 + s + n]
            mask = (wanted[:, 2 + s: 2 + s + n] & in_vocab[:, 1 + s: 1 + s + n]).float()
            logq = self.logits(hidden[:, :n]).float().log_softmax(-1)
            count = mask.sum().clamp(min=1.0)
            total = total + decay ** s * -((p_star * logq).sum(-1) * mask).sum() / count
            with torch.no_grad():
                agree = (logq.argmax(-1) == top_all[:, 1 + s: 1 + s + n]).float()
                metrics[f"acc_{s + 1}"] = float((agree * mask).sum() / count)
        metrics["loss"] = float(total.detach())
        return total, metrics

    # ---- checkpoints --------------------------------------------------------------------
    def save(self, folder: str | Path, target: Target, recipe: dict,
             dtype: torch.dtype | None = torch.bfloat16) -> Path:
        """Our folder format; ``dtype`` None keeps the parameters' dtype."""
        return save_ours(folder, "eagle3", self.state_dict(), target, asdict(self.config), self.taps, recipe, dtype,
                         draft_vocab=self.config.draft_vocab_size)

    @classmethod
    def load(cls, folder: str | Path, target: Target) -> "Eagle3Model":
        """Load our format or the official EAGLE-3 layout (told apart by config.json's "method")."""
        def ours(config: dict, state: dict[str, torch.Tensor]) -> Eagle3Model:
            arch = architecture(config, Eagle3Config, folder)
            taps = check_taps(config_value(config, "taps", folder), target, folder)
            return load_checked(_build(cls, arch, taps, target, folder), state, folder, "EAGLE-3")

        return load_ours_or_published(folder, target, "eagle3", ours,
                                      lambda path, raw: _load_official(cls, path, raw, target))


def _build(cls: type[Eagle3Model], arch: Eagle3Config, taps: Sequence[int], target: Target,
           folder: str | Path, own_embedding: torch.Tensor | None = None) -> Eagle3Model:
    check_layer_shapes(arch, target, folder, "an EAGLE-3")
    return cls(arch, taps, target.model.get_input_embeddings(), own_embedding)


def official_taps(raw: dict, target: Target, folder: Path) -> tuple[int, ...]:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge/SGLang: the output of layer i,
    i.e. HF ``hidden_states[i + 1]``), else the EAGLE-3 default taps of this target."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return eagle3_taps(target.num_layers)
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < target.num_layers - 1]
    if bad or not ids:
        raise SpecbenchError(f"drafter {folder} taps target layers {ids}, outside 0..{target.num_layers - 2} of "
                             f"target {target.name!r}; use the drafter published for this target")
    return tuple(i + 1 for i in ids)


def _load_official(cls: type[Eagle3Model], folder: Path, raw: dict, target: Target) -> Eagle3Model:
    speculators = is_speculators(raw)  # vLLM speculators' layout: translated to the flat one here
    if speculators:
        raw, speculators_taps = speculators_eagle3(raw, folder, target.num_layers)
    arch = Eagle3Config.from_official(raw, str(folder / CONFIG))
    if arch.tap_size != target.hidden_size:
        raise SpecbenchError(f"drafter {folder} fuses taps of hidden size {arch.tap_size} but target {target.name!r} "
                             f"has {target.hidden_size}; use an EAGLE-3 drafter trained for this target")
    taps = (speculators_taps or eagle3_taps(target.num_layers)) if speculators else official_taps(raw, target, folder)
    state = read_published_weights(folder, OFFICIAL_WEIGHTS, "EAGLE-3")
    if speculators:
        state = speculators_keys(state)
    own = None
    if arch.hidden_size != target.hidden_size:
        # Narrower/wider than the target: the official loader takes this drafter's embedding from its checkpoint.
        own = state.get("embed_tokens.weight")
        if own is None:
            raise SpecbenchError(f"EAGLE-3 checkpoint {folder} has hidden size {arch.hidden_size} (target "
                                 f"{target.hidden_size}) but no embed_tokens.weight of that width")
    if arch.draft_vocab_size == arch.vocab_size:
        # Full-vocabulary drafter: no mapping (the official loader deletes d2t/t2d; the file may omit them).
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    elif "d2t" in state and "t2d" not in state:  # t2d only marks the targets of d2t
        t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
        t2d[torch.arange(arch.draft_vocab_size) + state["d2t"].long()] = True
        state["t2d"] = t2d
    model = _build(cls, arch, taps, target, folder, own)
    if arch.draft_vocab_size == arch.vocab_size:
        state.update(d2t=model.d2t, t2d=model.t2d)  # the identity mapping
    return load_checked(model, state, folder, "EAGLE-3", OFFICIAL_IGNORED)


# ---- the drafter -----------------------------------------------------------------------------
@dataclass
class Eagle3Options(drafter_weights("Drafter folder", "ours or official EAGLE-3", "eagle3")):
    top_k: int = option(10, "Frontier width and children per frontier node.", ge=1)
    depth: int = option(7, "Tree-growing forwards after the first (tree depth <= depth + 1).", ge=1, tokens=True)
    total_tokens: int = option(60, "Verify rows incl. the root: at most total_tokens - 1 draft nodes.", ge=2,
                               tokens=True)


@dataclass
class _Frontier:
    """The top_k nodes expanded next: draft ids, output hidden of their parents, cumulative
    scores, candidate indices, and which transient tree-KV rows are their ancestors."""

    draft_ids: torch.Tensor  # [k]
    hidden: torch.Tensor  # [k, H]
    scores: torch.Tensor  # [k]
    index: torch.Tensor  # [k]
    ancestors: torch.Tensor  # [k, tree rows] bool


class Eagle3Drafter(Drafter):
    name = "eagle3"
    label = "EAGLE-3"
    Options = Eagle3Options
    weight_options = ("path",)
    budget_option, budget_counts_root = "total_tokens", True  # verify rows, the root included
    trainer = "methods.eagle3.trainer:Eagle3Trainer"

    def __init__(self, options: Eagle3Options | None = None, model: Eagle3Model | None = None) -> None:
        super().__init__(options)
        self.model = model

    def setup(self, target: Target) -> None:
        super().setup(target)
        if self.model is None:
            shipped = shipped_drafter(target.name, "eagle3")
            path = self.resolve_weights("path", shipped, f"eagle3 needs a drafter folder for target {target.name!r} "
                                        f"({{path}} does not exist); pass --opt path=FOLDER_OR_HUB_ID (ours or the "
                                        "official EAGLE-3 layout)")
            self.model = Eagle3Model.load(path, target)
        self.model.to(device=target.device, dtype=target.dtype).eval()
        self.taps = self.model.taps
        self.k = min(self.options.top_k, self.model.config.draft_vocab_size)
        # the compiled engine: the head's forwards too, over a static buffer (compiled_head.py)
        compiled = getattr(target, "engine", "eager") == "compiled"
        self.head = CompiledHead(self.model, self.k, self.options.depth) if compiled else None

    def begin(self, state: DecodeState, prefill: TargetOutput) -> None:
        cfg = self.model.config
        empty = torch.empty(1, cfg.num_key_value_heads, 0, cfg.head_dim, device=self.target.device,
                            dtype=self.model.dtype)
        self.stable: KV = (empty, empty)  # committed positions only
        self.pending = self.model.features(prefill.taps)  # taps of committed positions not yet encoded
        if self.head is not None:
            self.head.reset(self.target.static.cache.capacity)

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        last_hidden, first = self._encode_committed(state)
        tokens, parents, scores = self._grow(last_hidden, first, state)
        with state.timer.phase("tree_build"):
            return candidates_to_tree(self.model.to_target_ids(tokens).cpu(), parents.cpu(), scores.float().cpu(),
                                      self.options.total_tokens - 1)

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        # Tree keys/values never enter self.stable, so it already holds committed positions only;
        # the kept rows' taps (root + accepted) are the features of the next positions to encode.
        self.pending = self.model.features(result.taps)

    def _committed(self) -> int:
        """Committed positions encoded (drafter position j holds token j + 1)."""
        return self.head.rows if self.head is not None else self.stable[0].shape[2]

    def _encode_committed(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode pairs (features j, token j+1) for the new committed positions; return the last
        output hidden (features n-2 with the bonus), which proposes depth 1, and its log-probabilities."""
        start = self._committed()
        device = self.target.device
        ids = torch.tensor([state.tokens[start + 1:]], device=device)
        positions = torch.arange(start, start + ids.shape[1], device=device)[None]
        with state.timer.forward("drafter"):
            if self.head is not None:
                last, first = self.head.encode(self.pending, ids[0], state.timer)
            else:
                out, self.stable = self.model(self.pending[None], ids, positions, past=self.stable)
                last, first = out[0, -1], self._log_probs(out[0, -1:])[0]
        self.pending = self.pending[:0]
        return last, first

    def _level(self, front: _Frontier, kv: KV, committed: int, step: int, eye: torch.Tensor, state: DecodeState
               ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """One tree level's forward: every frontier node's output hidden [k, H] and log-probabilities. A node
        sees the committed positions, its ancestors among the earlier levels and itself."""
        m, k, device = self.model, self.k, front.draft_ids.device
        ids = m.to_target_ids(front.draft_ids)
        visible = torch.cat([torch.ones(k, committed, dtype=torch.bool, device=device), front.ancestors, eye], 1)
        positions = torch.full((1, k), committed + step, device=device)
        with state.timer.forward("drafter"):
            if self.head is not None:
                out, logp = self.head.level(front.hidden, ids, positions, visible, state.timer)
                return out, logp, kv
            out, kv = m(front.hidden[None], ids[None], positions, past=kv, visible=visible)
        return out[0], self._log_probs(out[0]), kv

    def _grow(self, last_hidden: torch.Tensor, first_logp: torch.Tensor, state: DecodeState
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Record every candidate of ``depth`` frontier expansions: (draft ids, parent candidate
        index or -1, cumulative log-prob), in topological order."""
        k = self.k
        scores, ids = first_logp.topk(k)
        device = ids.device
        eye = torch.eye(k, dtype=torch.bool, device=device)
        tokens, parents, all_scores = [ids], [torch.full_like(ids, -1)], [scores]
        front = _Frontier(ids, last_hidden.expand(k, -1), scores, torch.arange(k, device=device),
                          torch.zeros(k, 0, dtype=torch.bool, device=device))
        kv = self.stable
        # Drafter position j holds token j+1, so a depth-d node sits at (stable length) + d - 1.
        committed = self._committed()
        for step in range(self.options.depth):
            out, logp, kv = self._level(front, kv, committed, step, eye, state)
            child_lp, child_ids = logp.topk(k)
            cumulative = (front.scores[:, None] + child_lp).reshape(-1)
            first = sum(t.numel() for t in tokens)  # candidate index of this level's first child
            tokens.append(child_ids.reshape(-1))
            parents.append(front.index.repeat_interleave(k))
            all_scores.append(cumulative)
            best_scores, best = cumulative.topk(k)  # the next frontier: global top_k of the k*k children
            rows = best // k
            front = _Frontier(child_ids.reshape(-1)[best], out[rows], best_scores, first + best,
                              torch.cat([front.ancestors, eye], 1)[rows])
        return torch.cat(tokens), torch.cat(parents), torch.cat(all_scores)

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return log_probs(self.model, hidden)

    # ---- batches: every request's encode and every depth in one forward -------------------------
    batched_drafting = True

    def begin_batch(self, states, prefills) -> None:
        if not getattr(self, "rows", None):  # a batch that emptied starts a fresh stable cache
            cfg = self.model.config
            self.rows = RaggedKV(cfg.num_key_value_heads, cfg.head_dim, self.target.device, self.model.dtype)
            self.row_pending: list[torch.Tensor] = []
        self.rows.add_empty(len(states))
        self.row_pending += [self.model.features(prefill.taps) for prefill in prefills]

    def observe_batch(self, states, results) -> None:
        self.row_pending = [self.model.features(result.taps) for result in results]

    def end_batch(self, rows, states) -> list[dict]:
        self.rows.remove(rows)
        self.row_pending = [p for b, p in enumerate(self.row_pending) if b not in set(rows)]
        return [{} for _ in rows]

    @torch.inference_mode()
    def propose_batch(self, states) -> list[DraftTree]:
        timer = states[0].timer
        last_hidden = self._encode_batch(states, timer)
        tokens, parents, scores = self._grow_batch(last_hidden, timer)
        with timer.phase("tree_build"):
            tokens, parents, scores = self.model.to_target_ids(tokens).cpu(), parents.cpu(), scores.float().cpu()
            return [candidates_to_tree(tokens[b], parents[b], scores[b], self.options.total_tokens - 1)
                    for b in range(len(states))]

    def _encode_batch(self, states, timer) -> torch.Tensor:
        """``_encode_committed`` for every row at once (new positions right-padded to the longest);
        returns each row's last output hidden [B, H]."""
        rows, device = self.rows, self.target.device
        counts = [p.shape[0] for p in self.row_pending]
        n = max(counts)
        first = self.row_pending[0]
        hidden = torch.zeros(len(states), n, first.shape[-1], dtype=first.dtype, device=device)
        ids = torch.zeros(len(states), n, dtype=torch.long)
        for b, (state, pending, length) in enumerate(zip(states, self.row_pending, rows.lengths)):
            hidden[b, : counts[b]] = pending
            ids[b, : counts[b]] = torch.tensor(state.tokens[length + 1:])
        lengths = torch.tensor(rows.lengths, device=device)
        positions = lengths[:, None] + torch.arange(n, device=device)[None]
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        visible = torch.cat([rows.live()[:, None, :].expand(-1, n, -1), causal.expand(len(states), n, n)], 2)
        with timer.forward("drafter"):
            out, extended = self.model(hidden, ids.to(device), positions, past=rows.past, visible=visible)
        rows.keep(extended, [range(c) for c in counts])
        self.row_pending = [p[:0] for p in self.row_pending]
        return out[torch.arange(len(states), device=device), torch.tensor(counts, device=device) - 1]

    def _grow_batch(self, last_hidden: torch.Tensor, timer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_grow`` for every row at once: (draft ids, parent candidate or -1, cumulative log-prob) [B, C]."""
        k, m, rows = self.k, self.model, self.rows
        b = last_hidden.shape[0]
        scores, ids = self._log_probs(last_hidden).topk(k)  # [B, k]
        device = ids.device
        eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
        tokens, parents, all_scores = [ids], [torch.full_like(ids, -1)], [scores]
        hidden = last_hidden[:, None].expand(-1, k, -1)
        index = torch.arange(k, device=device).expand(b, k)
        ancestors = torch.zeros(b, k, 0, dtype=torch.bool, device=device)
        live = rows.live()[:, None, :].expand(-1, k, -1)
        lengths = torch.tensor(rows.lengths, device=device)
        kv, first = rows.past, k
        for step in range(self.options.depth):
            visible = torch.cat([live, ancestors, eye], 2)
            with timer.forward("drafter"):
                out, kv = m(hidden, m.to_target_ids(ids), (lengths + step)[:, None].expand(-1, k), past=kv,
                            visible=visible)
            child_lp, child_ids = self._log_probs(out).topk(k)  # [B, k, k]
            cumulative = (scores[:, :, None] + child_lp).reshape(b, -1)
            tokens.append(child_ids.reshape(b, -1))
            parents.append(index.repeat_interleave(k, dim=1))
            all_scores.append(cumulative)
            scores, best = cumulative.topk(k)  # the next frontier of every row: its global top_k
            parent_rows = best // k
            ids = child_ids.reshape(b, -1).gather(1, best)
            hidden = out.gather(1, parent_rows[..., None].expand(-1, -1, out.shape[-1]))
            grown = torch.cat([ancestors, eye], 2)
            ancestors = grown.gather(1, parent_rows[..., None].expand(-1, -1, grown.shape[-1]))
            index = first + best
            first += k * k
        return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(all_scores, 1)
