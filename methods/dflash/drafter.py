"""DFlash: a block drafter that predicts the L-1 tokens after the bonus in ONE non-causal forward,
conditioned on target features; ``dflash`` verifies the argmax chain of that block (docs/methods.md#dflash).

Architecture (Qwen3-style layers, our own code):

* context c_j = RMSNorm(fc([taps of target layers ``target_layer_ids`` at j])), taps =
  ``hidden_states[id + 1]``;
* ``n_d`` decoder layers; in every layer keys/values = [k_proj(c_context); k_proj(x_block)]
  (same for v) with per-head q/k RMSNorm, queries from the block only, no causal mask in the block;
* block = the target's (frozen) embeddings of [bonus, MASK x (L-1)] at positions n..n+L-1; final
  RMSNorm -> the target's (frozen) lm_head; outputs 1..L-1 are the marginals q_1..q_{L-1}.

Context keys/values depend on c only, so the drafter caches them for committed positions (taps of
the rows the engine keeps) and never caches block rows: nothing needs cropping.

Training (docs/methods.md#dflash-training, the SpecForge recipe): random anchors a among assistant tokens
(a <= len - L), block [x_a, MASK...] at a..a+L-1, a block sees context features at positions < a
and its own block only; slot k predicts x_{a+k}, CE weighted exp(-(k-1)/gamma) / sum of weights.

Checkpoints: our folder format (target fingerprint) or the published z-lab layout (Qwen3 config.json
with ``dflash_config.target_layer_ids`` / ``mask_token_id`` and ``block_size``, each also read at the
top level as z-lab's ``_draft_value`` does; whole or sharded weights); module names follow the
published keys, so one state-dict layout serves both.

In a batch (``--batch-size``) one drafter forward serves every request: the newly committed context
rows of all requests (right-padded to the longest) are encoded together into a ragged context cache
(per layer a ``RaggedKV``: one row per request at its own length), and every request's block reads its
own committed context through the mask, at its own positions.

Per-layer attention (z-lab ``Qwen3DFlashAttention``): a ``sliding_attention`` layer of ``layer_types``
is causal inside the block and sees keys less than ``sliding_window`` positions back; a
``full_attention`` layer is bidirectional; a config-wide ``is_causal`` overrides the causality of
every layer. DFlash-2 drafters (convolutions and a candidate selector) are refused in one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from methods.checkpoints import (check_layer_shapes, load_checked, load_ours_or_published, read_published_weights,
                                 save_ours, shipped_drafter)
from methods.layers import KV, DecoderLayer, LayerShapes, RMSNorm, Rotary, official_layer_shapes, target_layer_shapes
from methods.speculators_layout import is_speculators, speculators_dflash
from methods.weights_options import drafter_weights
from specbench.engine.batch_cache import RaggedKV
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.engine.target import Target, TargetOutput
from specbench.training.batch import TrainBatch
from specbench.training.checkpoint import CONFIG, architecture
from specbench.engine.tree import DraftTree, SiblingKind

METHOD = "dflash"
OFFICIAL_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
OFFICIAL_IGNORED = ("*rotary_emb.inv_freq",)  # derived from config
LAYER_TYPES = ("full_attention", "sliding_attention")  # the per-layer attention kinds z-lab's drafter knows
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # DFlash-2 only
DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # loss decay per block size (SpecForge's published settings)
MAX_ANCHORS = 512  # per sequence, as in the reference recipe
MIN_LOSS_TOKENS = 32  # shorter responses are dropped from training


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """One tap per drafter layer, evenly spaced over layers 1..L-3 (a single layer taps L/2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def decay_gamma(block_size: int) -> float:
    return DECAY_GAMMA.get(block_size, max(1.0, round(block_size * 7 / 16)))


# ---- architecture ----------------------------------------------------------------------------
@dataclass
class DFlashConfig(LayerShapes):
    num_hidden_layers: int  # drafter layers
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    draft_vocab_size: int = 0  # 0 = the target's whole lm_head (published); else a subset of its rows
    # Published dflash_config knobs (z-lab dflash/model.py): block input embeddings x scale; logits
    # x multiplier, then tanh soft-capping when > 0.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    # Per drafter layer "full_attention" | "sliding_attention" (empty = all full); the window of the
    # sliding ones (0 = none); is_causal None = causal exactly in the sliding layers, else every layer.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0
    is_causal: bool | None = None

    def layer_attention(self, index: int) -> tuple[bool, int]:
        """(causal inside the block, window or 0) of drafter layer ``index``, as z-lab's attention sets them."""
        kind = self.layer_types[index] if self.layer_types else "full_attention"
        causal = kind == "sliding_attention" if self.is_causal is None else bool(self.is_causal)
        return causal, self.sliding_window if kind == "sliding_attention" else 0

    @classmethod
    def from_target(cls, target: Target, layers: int, block_size: int, mask_token_id: int,
                    target_layer_ids: Sequence[int] | None = None, draft_vocab_size: int = 0) -> "DFlashConfig":
        ids = list(target_layer_ids) if target_layer_ids else default_layer_ids(target.num_layers, layers)
        return cls(**target_layer_shapes(target), num_hidden_layers=layers, num_target_layers=target.num_layers,
                   block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
                   draft_vocab_size=draft_vocab_size)

    @classmethod
    def from_official(cls, raw: dict, source: str) -> "DFlashConfig":
        """From a published DFlash ``config.json`` (Qwen3 keys + ``dflash_config``)."""
        extra = raw.get("dflash_config") or {}

        def value(name: str, default=None):  # dflash_config first, then the top level (z-lab's _draft_value)
            found = extra.get(name, raw.get(name))
            return default if found is None else found

        refuse_dflash2(raw, source)
        no_mask = () if value("mask_token_id") is not None else ("dflash_config.mask_token_id",)
        shapes = official_layer_shapes(raw, source, "DFlash", required=("num_hidden_layers",), missing=no_mask)
        layers = raw["num_hidden_layers"]
        target_layers = raw.get("num_target_layers")
        ids = value("target_layer_ids") or (default_layer_ids(target_layers, layers) if target_layers else None)
        if not ids:
            raise SpecbenchError(f"{source} has neither dflash_config.target_layer_ids nor num_target_layers")
        types, window = official_layer_types(raw, layers, source)
        causal = raw.get("is_causal")  # z-lab reads the config attribute itself, not dflash_config
        return cls(**shapes, num_hidden_layers=layers, num_target_layers=target_layers or max(ids) + 1,
                   block_size=int(value("block_size", 16)), mask_token_id=int(value("mask_token_id")),
                   target_layer_ids=[int(i) for i in ids],
                   input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                   output_multiplier=float(value("output_multiplier", 1.0)),
                   final_logit_softcapping=float(value("final_logit_softcapping", 0.0)),
                   layer_types=types, sliding_window=window, is_causal=None if causal is None else bool(causal))


def refuse_dflash2(raw: dict, source: str) -> None:
    """DFlash-2 (z-lab ``DFlash2DraftModel``, speculators ``dflash2``) adds modules this drafter lacks: one line."""
    extra = raw.get("dflash_config") or {}
    named = "DFlash2DraftModel" in (raw.get("architectures") or []) or raw.get("speculators_model_type") == "dflash2"
    if named or any(k in extra or k in raw for k in DFLASH2_KEYS):
        raise SpecbenchError(f"{source} is a DFlash-2 drafter, which specbench cannot run: it lacks DFlash-2's grouped "
                             "dynamic causal convolutions around each layer's attention and MLP and its candidate "
                             "selector (selector_rank/selector_top_k re-ranking of the block); use a DFlash "
                             "(DFlashDraftModel) drafter")


def official_layer_types(raw: dict, layers: int, source: str) -> tuple[list[str], int]:
    """(layer_types, sliding window or 0) as transformers' Qwen3Config derives them for z-lab's drafter:
    ``layer_types`` if given, else sliding from layer ``max_window_layers`` on when ``use_sliding_window``;
    the window is ``sliding_window`` only when ``use_sliding_window`` is set (else None in Qwen3Config)."""
    use = bool(raw.get("use_sliding_window"))
    window = raw.get("sliding_window") if use else None
    types = raw.get("layer_types")
    if types is None:
        start = raw.get("max_window_layers", 28)  # Qwen3Config's default
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise SpecbenchError(f"{source} has layer_types for {len(types) if isinstance(types, list) else 'no list of'} "
                             f"layers but num_hidden_layers={layers}; fix the config")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise SpecbenchError(f"{source} declares attention type(s) {', '.join(map(str, unknown))}, which this DFlash "
                             f"loader does not run (it knows {', '.join(LAYER_TYPES)})")
    if "sliding_attention" in types and window is not None and (not isinstance(window, int) or window < 1):
        raise SpecbenchError(f"{source} has sliding_window={window!r}; a sliding_attention layer needs a positive "
                             "integer window")
    return list(types), int(window or 0)


class DFlashModel(nn.Module):
    """fc + hidden_norm (context), ``n_d`` layers, final norm. The target's embedding and lm_head
    are referenced, frozen, never registered (so neither trained nor saved)."""

    def __init__(self, config: DFlashConfig, target: Target | None = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm=True) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.draft_vocab_size:  # target ids of the lm_head rows the drafter scores, ascending
            self.register_buffer("vocab_ids", torch.arange(config.draft_vocab_size))
        self.rotary = Rotary(config)
        self._target: tuple[nn.Module, nn.Module] | tuple = ()
        self._head_rows: torch.Tensor | None = None
        if target is not None:
            self.attach(target)

    def attach(self, target: Target) -> None:
        self._target = (target.model.get_input_embeddings(), target.model.get_output_embeddings())
        self._head_rows = None

    @classmethod
    def from_target(cls, target: Target, layers: int = 3, block_size: int = 16, mask_token_id: int = 0,
                    target_layer_ids: Sequence[int] | None = None,
                    vocab_ids: torch.Tensor | None = None) -> "DFlashModel":
        """A fresh drafter; ``vocab_ids`` (ascending target ids) restricts the lm_head to those rows."""
        size = 0 if vocab_ids is None else int(vocab_ids.numel())
        cfg = DFlashConfig.from_target(target, layers, block_size, mask_token_id, target_layer_ids, size)
        _check(cfg, target, "new drafter")
        model = cls(cfg, target)
        if vocab_ids is not None:
            model.vocab_ids.copy_(vocab_ids)
        # Block rows start as frozen token embeddings; through a tied lm_head at full scale the MASK
        # row's own direction scores ~100+ logits (SmolLM2). Starting the final norm at a tenth of
        # the target's keeps initial logits near uniform; the norm is trained.
        final_norm = getattr(getattr(target.model, "model", None), "norm", None)
        with torch.no_grad():
            if final_norm is not None and final_norm.weight.shape == model.norm.weight.shape:
                model.norm.weight.copy_(0.1 * final_norm.weight.float())
            else:
                model.norm.weight.fill_(0.1)
        return model.to(target.device)

    # ---- building blocks ----------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def taps(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices read: the output of layer l is ``hidden_states[l + 1]``."""
        return tuple(i + 1 for i in self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def features(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([taps[i] for i in self.taps], -1)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._target:
            raise RuntimeError("DFlashModel has no target embedding; call attach(target) first")
        with torch.no_grad():
            return (self._target[0](ids) * self.config.input_embedding_scale).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target lm_head (its draft-vocabulary rows) on the final norm -> [..., draft V]; the lm_head
        stays frozen (gradients reach ``hidden`` only)."""
        weight = self._head_rows
        if weight is None or weight.dtype != hidden.dtype or weight.device != hidden.device:
            weight = self._target[1].weight.detach()
            if self.config.draft_vocab_size:
                weight = weight[self.vocab_ids.to(weight.device)]
            weight = self._head_rows = weight.to(hidden.dtype)
        logits = F.linear(self.norm(hidden), weight)
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping > 0:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[draft_ids] if self.config.draft_vocab_size else draft_ids

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft index of each target id, -1 outside the draft vocabulary."""
        if not self.config.draft_vocab_size:
            return target_ids
        device = target_ids.device
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=device)
        index[self.vocab_ids.to(device)] = torch.arange(self.config.draft_vocab_size, device=device)
        return index[target_ids]

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Per-layer keys/values of context rows [B, S, H] at ``positions`` [B, S]."""
        cos, sin = self.rotary(positions, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(self, block_ids: torch.Tensor, block_positions: torch.Tensor, context: list[KV],
                visible: torch.Tensor | None = None, context_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Block hidden states [B, Q, H] (before the final norm).

        block_ids, block_positions [B, Q]; context: per-layer KV of the context rows (S of them) at
        ``context_positions`` [B or 1, S] (None = 0..S-1); visible [B or 1, 1, Q, S + Q] bool, None =
        every row sees everything (one block); causal and sliding layers narrow it (``layer_masks``)."""
        x = self.embed(block_ids)
        cos, sin = self.rotary(block_positions, x.dtype)
        masks = self.layer_masks(visible, block_positions, context[0][0].shape[2] if context else 0, context_positions)
        for layer, kv, mask in zip(self.layers, context, masks):
            x, _ = layer(x, cos, sin, mask, past=kv)
        return x

    def layer_masks(self, visible: torch.Tensor | None, block_positions: torch.Tensor, context_len: int,
                    context_positions: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """Per layer: ``visible`` narrowed to keys at or before the query (causal layers) and less than
        the window away (sliding layers; both ways when not causal), by absolute position, as z-lab's
        ``_attention_mask`` does over its cache (whose key index is the position)."""
        kinds = [self.config.layer_attention(i) for i in range(self.config.num_hidden_layers)]
        if not any(causal or window for causal, window in kinds):
            return [visible] * len(kinds)
        if context_positions is None:
            context_positions = torch.arange(context_len, device=block_positions.device)[None]
        keys = torch.cat([context_positions.expand(block_positions.shape[0], -1), block_positions], 1)
        behind = block_positions[:, :, None] - keys[:, None, :]  # query position - key position, [B, Q, S + Q]
        masks: dict[tuple[bool, int], torch.Tensor | None] = {}
        for kind in set(kinds):
            causal, window = kind
            mask = torch.ones_like(behind, dtype=torch.bool)
            if causal:
                mask &= behind >= 0
            if window:
                mask &= (behind < window) if causal else (behind.abs() < window)
            mask = mask[:, None]
            masks[kind] = mask if visible is None else mask & visible
        return [masks[k] for k in kinds]

    # ---- training -----------------------------------------------------------------------
    def training_loss(self, batch: TrainBatch, anchors: int = 64,
                      gamma: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Position-decayed block CE (docs/methods.md#dflash-training) over random anchors; in eval mode a fixed
        generator and up to MAX_ANCHORS anchors make held-out numbers comparable across evals.
        Labels outside a reduced draft vocabulary are left out of the loss and count as misses.

        Metrics: ``loss``, top-1 ``acc_k`` of slot k vs x_{a+k}, and ``chain_len`` = 1 + mean
        number of leading correct slots (the teacher-forced τ of the argmax chain)."""
        L = self.block_size
        gen = None if self.training else torch.Generator().manual_seed(0)
        starts, valid = sample_anchors(batch.loss_mask, batch.attention_mask, L,
                                       anchors if self.training else MAX_ANCHORS, gen)
        device = batch.input_ids.device
        starts, valid = starts.to(device), valid.to(device)
        hidden = self.block_hidden(batch.input_ids, batch.taps, starts)  # [B, nb, L, H]
        labels = self.to_draft_ids(block_labels(batch.input_ids, starts, L))  # [B, nb, L-1], -1 = outside
        weights = torch.exp(-torch.arange(L - 1, device=device) / (gamma or decay_gamma(L)))
        rows = valid[..., None] & (labels >= 0)
        logits = self.logits(hidden[:, :, 1:][rows]).float()  # [R, V], R = valid (anchor, slot) pairs
        ce = F.cross_entropy(logits, labels[rows], reduction="none")
        w = weights.expand_as(labels)[rows]
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        with torch.no_grad():
            correct = torch.zeros_like(labels, dtype=torch.bool)
            correct[rows] = logits.argmax(-1) == labels[rows]
            metrics = {"loss": float(loss.detach())}
            n = valid.sum().clamp(min=1)
            for k in range(L - 1):
                metrics[f"acc_{k + 1}"] = float((correct[..., k] & valid).sum() / n)
            metrics["chain_len"] = float(1 + (correct.long().cumprod(-1).sum(-1) * valid).sum() / n)
        return loss, metrics

    def block_hidden(self, input_ids: torch.Tensor, taps: dict[int, torch.Tensor],
                     starts: torch.Tensor) -> torch.Tensor:
        """All blocks of a batch in one forward: block i of row b = [x_a, MASK...] at a..a+L-1,
        a = starts[b, i]; it sees context positions < a and its own block only. -> [B, nb, L, H]."""
        b, t = input_ids.shape
        nb, L = starts.shape[1], self.block_size
        device = input_ids.device
        offsets = torch.arange(L, device=device)
        positions = (starts[..., None] + offsets).reshape(b, nb * L)
        ids = torch.full((b, nb, L), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, :, 0] = input_ids.gather(1, starts)
        context = self.context(self.features(taps))
        kv = self.context_kv(context, torch.arange(t, device=device).expand(b, t))
        visible = training_mask(starts, t, L)[:, None]
        return self(ids.reshape(b, nb * L), positions, kv, visible).view(b, nb, L, -1)

    # ---- checkpoints --------------------------------------------------------------------
    def save(self, folder: str | Path, target: Target, recipe: dict,
             dtype: torch.dtype | None = torch.bfloat16) -> Path:
        # the published keys too, so other DFlash tooling can read the folder
        return save_ours(folder, METHOD, self.state_dict(), target, asdict(self.config), self.taps, recipe, dtype,
                         block_size=self.block_size,
                         dflash_config={"target_layer_ids": list(self.config.target_layer_ids),
                                        "mask_token_id": self.config.mask_token_id})

    @classmethod
    def load(cls, folder: str | Path, target: Target) -> "DFlashModel":
        """Our format or the published DFlash layout (told apart by config.json's "method"), loaded in
        the checkpoint's own dtype (exact round trip)."""
        def ours(config: dict, state: dict[str, torch.Tensor]) -> DFlashModel:
            arch = architecture(config, DFlashConfig, folder)
            _check(arch, target, folder)
            return load_checked(cls(arch, target), state, folder, "DFlash")

        return load_ours_or_published(folder, target, METHOD, ours,
                                      lambda path, raw: _load_official(cls, path, raw, target))


def _check(cfg: DFlashConfig, target: Target, folder) -> None:
    check_layer_shapes(cfg, target, folder, "a DFlash")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise SpecbenchError(f"DFlash drafter {folder} has mask id {cfg.mask_token_id}, outside the vocabulary of "
                             f"target {target.name!r} ({target.vocab_size} tokens)")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers - 1]
    if bad:
        raise SpecbenchError(f"DFlash drafter {folder} taps target layers {bad}, outside 0..{target.num_layers - 2} "
                             f"of target {target.name!r}")
    if cfg.block_size < 2:
        raise SpecbenchError(f"DFlash drafter {folder} has block size {cfg.block_size}; need >= 2")


def _load_official(cls, folder: Path, raw: dict, target: Target) -> DFlashModel:
    if is_speculators(raw):  # vLLM speculators' layout, as z-lab's
        raw = speculators_dflash(raw, folder, target.num_layers)
    cfg = DFlashConfig.from_official(raw, str(folder / CONFIG))
    # z-lab's loader does not need num_target_layers; where the config gives it, it must be this target's.
    if raw.get("num_target_layers") and cfg.num_target_layers != target.num_layers:
        raise SpecbenchError(f"DFlash drafter {folder} was built for a {cfg.num_target_layers}-layer target but "
                             f"{target.name!r} has {target.num_layers}; use the drafter published for this target")
    _check(cfg, target, folder)
    state = read_published_weights(folder, OFFICIAL_WEIGHTS, "DFlash")
    return load_checked(cls(cfg, target), state, folder, "DFlash", OFFICIAL_IGNORED)


# ---- training helpers (pure) -----------------------------------------------------------------
def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, block: int, count: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` random anchors per row among assistant tokens a with a <= len - block (the
    whole block has labels) and a >= 1 (some context); rows with < MIN_LOSS_TOKENS assistant tokens
    get none. Returns (starts [B, n], valid [B, n]), sorted per row, padded with invalid a = 1."""
    loss_mask, attention_mask = loss_mask.cpu(), attention_mask.cpu()
    lengths = attention_mask.sum(1)
    picked: list[torch.Tensor] = []
    for row in range(loss_mask.shape[0]):
        ok = loss_mask[row].bool() & attention_mask[row].bool()
        candidates = ok.nonzero().flatten()
        candidates = candidates[(candidates >= 1) & (candidates <= lengths[row] - block)]
        if int(ok.sum()) < MIN_LOSS_TOKENS:
            candidates = candidates[:0]
        if candidates.numel() > count:
            candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]].sort().values
        picked.append(candidates)
    width = max(1, max(p.numel() for p in picked))
    starts = torch.ones(len(picked), width, dtype=torch.long)
    valid = torch.zeros(len(picked), width, dtype=torch.bool)
    for row, p in enumerate(picked):
        starts[row, : p.numel()] = p
        valid[row, : p.numel()] = True
    return starts, valid


def block_labels(input_ids: torch.Tensor, starts: torch.Tensor, block: int) -> torch.Tensor:
    """x_{a+k} for k = 1..block-1 -> [B, nb, block-1] (indices clamped; invalid anchors are masked)."""
    index = (starts[..., None] + torch.arange(1, block, device=starts.device)).clamp(max=input_ids.shape[1] - 1)
    return input_ids.gather(1, index.flatten(1)).view(index.shape)


def training_mask(starts: torch.Tensor, context_len: int, block: int) -> torch.Tensor:
    """[B, nb*L, T + nb*L] bool: a row of block i sees context positions < a_i and block i's rows."""
    b, nb = starts.shape
    device = starts.device
    row_start = starts.repeat_interleave(block, dim=1)  # [B, Q]
    sees_context = torch.arange(context_len, device=device)[None, None] < row_start[..., None]
    block_of = torch.arange(nb, device=device).repeat_interleave(block)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context, sees_block], -1)


# ---- the drafter -----------------------------------------------------------------------------
@dataclass
class DFlashOptions(drafter_weights("Drafter folder", "ours or the published z-lab layout", "dflash")):
    """Only the weights: the block size and the target layers it reads come with the checkpoint."""


class DFlashDrafter(Drafter):
    """Vanilla DFlash: verify the argmax chain of one block (L-1 nodes)."""

    name = METHOD
    Options = DFlashOptions
    label = "DFlash"
    weight_options = ("path",)
    trainer = "methods.dflash.trainer:DFlashTrainer"

    def __init__(self, options=None, model: DFlashModel | None = None) -> None:
        super().__init__(options)
        self.model = model

    def setup(self, target: Target) -> None:
        super().setup(target)
        if self.model is None:
            self.model = DFlashModel.load(self._folder(target), target)
        self.model.attach(target)
        self.model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.taps = self.model.taps

    def _folder(self, target: Target) -> Path:
        shipped = shipped_drafter(target.name, METHOD)
        folder = self.resolve_weights("path", shipped, f"{self.name} needs a DFlash drafter for target {target.name!r} "
                                      f"({{path}} does not exist); train one with `specbench train dflash` or pass "
                                      "--opt path=FOLDER_OR_HUB_ID")
        if not (folder / CONFIG).is_file():
            raise SpecbenchError(f"{self.name} needs a DFlash drafter for target {target.name!r} ({folder} has no "
                                 f"{CONFIG}); train one with `specbench train dflash` or pass --opt path=FOLDER")
        return folder

    def begin(self, state: DecodeState, prefill: TargetOutput) -> None:
        self.cache: list[KV] | None = None  # per layer: context keys/values of committed positions
        self.pending = self.model.features(prefill.taps)  # taps of committed positions not yet encoded

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        # Kept rows = [old bonus, accepted...]: exactly the committed positions the cache lacks.
        self.pending = self.model.features(result.taps)

    @torch.inference_mode()
    def block_log_probs(self, state: DecodeState) -> torch.Tensor:
        """One drafter forward -> log q_1..q_{L-1} [L-1, draft V] (float32, untempered)."""
        m = self.model
        start = 0 if self.cache is None else self.cache[0][0].shape[2]
        bonus_pos = len(state.tokens) - 1
        if start + self.pending.shape[0] != bonus_pos:
            raise RuntimeError(f"dflash: context covers {start + self.pending.shape[0]} positions, "
                               f"expected {bonus_pos}")
        device = self.target.device
        ids = torch.full((1, m.block_size), m.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = state.bonus
        with state.timer.forward("drafter"):
            new = m.context_kv(m.context(self.pending[None]), torch.arange(start, bonus_pos, device=device)[None])
            self.cache = new if self.cache is None else [
                (torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.cache, new)]
            hidden = m(ids, torch.arange(bonus_pos, bonus_pos + m.block_size, device=device)[None], self.cache)
            logits = m.logits(hidden[0, 1:]).float()
        self.pending = self.pending[:0]
        return logits.log_softmax(-1)

    def propose(self, state: DecodeState) -> DraftTree:
        log_q = self.block_log_probs(state)
        with state.timer.phase("tree_build"):
            return self.tree_from(log_q)

    def tree_from(self, log_q: torch.Tensor) -> DraftTree:
        """The draft of one block's marginals log_q [L-1, draft V]: the chain of argmaxes."""
        return DraftTree.chain(self.model.to_target_ids(log_q.argmax(-1)).cpu(), kind=SiblingKind.DETERMINISTIC)

    def end(self, state: DecodeState) -> dict:
        return {"block_size": self.model.block_size}

    # ---- batches: every request's context and block in one drafter forward -----------------------
    batched_drafting = True

    def begin_batch(self, states, prefills) -> None:
        if not hasattr(self, "rows"):  # the first batch: a context cache per layer (rows come and go with requests)
            cfg = self.model.config
            self.rows = [RaggedKV(cfg.num_key_value_heads, cfg.head_dim, self.target.device, self.model.dtype)
                         for _ in range(cfg.num_hidden_layers)]
            self.row_pending: list[torch.Tensor] = []
        for layer in self.rows:
            layer.add_empty(len(states))
        self.row_pending += [self.model.features(prefill.taps) for prefill in prefills]

    def observe_batch(self, states, results) -> None:
        self.row_pending = [self.model.features(result.taps) for result in results]

    def end_batch(self, rows, states) -> list[dict]:
        for layer in self.rows:
            layer.remove(rows)
        gone = set(rows)
        self.row_pending = [p for b, p in enumerate(self.row_pending) if b not in gone]
        return [self.end(state) for state in states]

    def propose_batch(self, states) -> list[DraftTree]:
        log_q = self.block_log_probs_batch(states)
        with states[0].timer.phase("tree_build"):
            return [self.tree_from(row) for row in log_q]

    @torch.inference_mode()
    def block_log_probs_batch(self, states) -> torch.Tensor:
        """``block_log_probs`` of every request in ONE drafter forward -> [B, L-1, draft V]."""
        m, device = self.model, self.target.device
        lengths, counts = self.rows[0].lengths, [p.shape[0] for p in self.row_pending]
        bonus_pos = [len(state.tokens) - 1 for state in states]
        for length, count, pos in zip(lengths, counts, bonus_pos):
            if length + count != pos:
                raise RuntimeError(f"dflash: context covers {length + count} positions, expected {pos}")
        b, n, size = len(states), max(counts), m.block_size
        features = self.row_pending[0].new_zeros(b, n, self.row_pending[0].shape[-1])
        for row, pending in enumerate(self.row_pending):
            features[row, : counts[row]] = pending
        ids = torch.full((b, size), m.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([state.bonus for state in states])
        offsets = torch.arange(max(n, size), device=device)
        starts = torch.tensor(lengths, device=device)[:, None]
        with states[0].timer.forward("drafter"):
            new = m.context_kv(m.context(features), starts + offsets[:n])  # padding rows are dropped by keep
            for layer, (keys, values) in zip(self.rows, new):
                layer.keep((torch.cat([layer.keys, keys], 2), torch.cat([layer.values, values], 2)),
                           [range(c) for c in counts])
            live = self.rows[0].live()[:, None, :].expand(-1, size, -1)  # each block sees its own context
            visible = torch.cat([live, live.new_ones(b, size, size)], 2)[:, None]
            positions = torch.tensor(bonus_pos, device=device)[:, None] + offsets[:size]
            hidden = m(ids.to(device), positions, [layer.past for layer in self.rows], visible)
            logits = m.logits(hidden[:, 1:]).float()
        self.row_pending = [p[:0] for p in self.row_pending]
        return logits.log_softmax(-1)


def choose_mask_token(tokenizer, examples: Sequence[dict]) -> int:
    """The tokenizer's mask token, else the highest-id added (special-looking) token that is not
    BOS/EOS/PAD and never occurs in the training sequences: its frozen embedding is a fixed input
    the drafter can learn to read as MASK. SmolLM2 has no mask token; this picks <empty_output> (16)."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    used = set()
    for e in examples:
        used.update(e["prompt_ids"])
        used.update(e["response_ids"])
    special = set(getattr(tokenizer, "all_special_ids", []))
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    free = [i for i in added if i not in used and i not in special]
    if not free:
        raise SpecbenchError("no unused added token to serve as DFlash's MASK; pass --mask-token-id")
    return int(free[-1])

