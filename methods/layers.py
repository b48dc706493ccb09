"""Llama-style building blocks the feature-space drafters share (EAGLE-3, SpecBlock, DFlash): the
target's layer shapes as config fields, rotary embedding, RMSNorm, SwiGLU MLP, GQA attention and
a decoder layer.

Module and parameter names are the published ones (``self_attn.q_proj``, ``input_layernorm``,
``mlp.gate_proj``, ...), so every drafter's state dict keeps the keys of its published checkpoints.
Attention takes explicit boolean masks (True = attend) and keys/values from outside (a cache or
context rows) so that training and inference share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specbench.errors import SpecbenchError
from specbench.training.checkpoint import found_layout

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [B, kv_heads, S, head_dim]


# ---- config ----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class LayerShapes:
    """Per-layer shapes, norm, activation and RoPE of a Llama-style layer (the fields drafters copy
    from their target); each drafter's config adds its own fields."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters beyond theta (llama3, linear, ...)
    max_position_embeddings: int = 2048


def rope_of(cfg) -> tuple[float, dict | None]:
    """(theta, scaling) from an HF config or a config.json dict: ``rope_parameters`` (transformers 5)
    or rope_theta/rope_scaling."""
    get = cfg.get if isinstance(cfg, dict) else (lambda key: getattr(cfg, key, None))
    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or get("rope_theta") or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if kind != "default" else None)


def target_layer_shapes(target) -> dict:
    """The target's ``LayerShapes`` fields (drafters built from the target's layer shapes share them)."""
    cfg = target.config
    heads = cfg.num_attention_heads
    theta, scaling = rope_of(cfg)
    return dict(hidden_size=cfg.hidden_size, num_attention_heads=heads,
                num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                intermediate_size=cfg.intermediate_size, rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
                vocab_size=target.vocab_size, hidden_act=getattr(cfg, "hidden_act", "silu"), rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048) or 2048)


def official_layer_shapes(raw: dict, source: str, kind: str, eps: float = 1e-6, required: Sequence[str] = (),
                          missing: Sequence[str] = ()) -> dict:
    """``LayerShapes`` fields from a published drafter's Llama/Qwen-style ``config.json``. ``eps``: the
    trainer's default when the file omits ``rms_norm_eps``; ``required``: further top-level keys the
    caller needs; ``missing``: names the caller found missing elsewhere (all named in one line)."""
    keys = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", *required)
    lacking = [k for k in keys if k not in raw] + list(missing)
    if lacking:
        raise SpecbenchError(f"{source} lacks {', '.join(lacking)}; it is not a{'n' if kind[0] in 'AEIOU' else ''} "
                             f"{kind} drafter ({found_layout(Path(source).parent)})")
    heads = raw["num_attention_heads"]
    theta, scaling = rope_of(raw)
    return dict(hidden_size=raw["hidden_size"], num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", eps),
                vocab_size=raw["vocab_size"], hidden_act=raw.get("hidden_act", "silu"), rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=raw.get("max_position_embeddings", 2048))


# ---- rotary embedding ------------------------------------------------------------------------
class Rotary:
    """cos/sin for explicit positions. inv_freq comes from transformers' RoPE initialisers (all
    scaling types) and stays fp32: it is not a module buffer, so casting the model cannot round it."""

    def __init__(self, cfg: LayerShapes) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        # transformers warns when the pre-scaling context exceeds max_position_embeddings; it only sizes tables.
        longest = max(cfg.max_position_embeddings, (cfg.rope_scaling or {}).get("original_max_position_embeddings", 0))
        heads = cfg.num_attention_heads
        hf = LlamaConfig(hidden_size=heads * cfg.head_dim, num_attention_heads=heads,
                         head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                         max_position_embeddings=longest)
        emb = LlamaRotaryEmbedding(hf)
        self.inv_freq = emb.inv_freq.float()
        self.scale = float(emb.attention_scaling)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, N] -> cos, sin [B, 1, N, head_dim]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat([freqs, freqs], -1)[:, None]
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [B, heads, N, d] (Llama's rotate-half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: each key/value head serves ``groups`` query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ---- layers ----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Llama RMSNorm (statistics in fp32, as the published weights were trained with). Our own rather
    than transformers' LlamaRMSNorm, which kernel hubs may swap for a fused kernel with other rounding."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: LayerShapes) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA attention with the target's head shapes. ``input_size``: width of the rows projected to
    q/k/v (EAGLE-3 reads 2H); ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3)."""

    def __init__(self, cfg: LayerShapes, input_size: int | None = None, qk_norm: bool = False) -> None:
        super().__init__()
        d, h, kvh = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        width = input_size or cfg.hidden_size
        self.q_proj = nn.Linear(width, h * d, bias=False)
        self.k_proj = nn.Linear(width, kvh * d, bias=False)
        self.v_proj = nn.Linear(width, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.heads, self.kv_heads, self.head_dim = h, kvh, d
        self.groups = h // kvh

    def _split(self, proj: nn.Linear, x: torch.Tensor, heads: int, norm: RMSNorm | None = None) -> torch.Tensor:
        """rows [B, N, width] -> [B, heads, N, d]."""
        b, n, _ = x.shape
        y = proj(x).view(b, n, heads, self.head_dim)
        return (y if norm is None else norm(y)).transpose(1, 2)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(self._split(self.q_proj, x, self.heads, self.q_norm), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Rotated keys and values of rows x [B, N, width] -> [B, kv_heads, N, d]."""
        k = rotate(self._split(self.k_proj, x, self.kv_heads, self.k_norm), cos, sin)
        return k, self._split(self.v_proj, x, self.kv_heads)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention -> [B, heads, N, d]; mask [N, S] or [B, N, S] (a head axis is
        added) or [B, 1, N, S], bool True = attend; None = every row sees every key."""
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]
        return F.scaled_dot_product_attention(q, repeat_kv(keys, self.groups), repeat_kv(values, self.groups),
                                              attn_mask=mask)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """[B, heads, N, d] -> o_proj -> [B, N, H]."""
        b, _, n, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """Rows x [B, N, width] attend over ``past`` keys/values (a cache or context rows; S of them)
        then their own; mask [.., N, S + N]. Returns the output [B, N, H] and the new rows' keys/values."""
        q = self.queries(x, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        return self.output(self.attend(q, keys, values, mask)), (k, v)


class DecoderLayer(nn.Module):
    """A pre-norm Llama decoder layer with the target's shapes.

    ``fused_input`` (EAGLE-3): attention reads [input_layernorm(embedding); hidden_norm(x)] (2H) while
    the residual stream stays x; ``qk_norm`` (Qwen3-style DFlash): see ``Attention``."""

    def __init__(self, cfg: LayerShapes, fused_input: bool = False, qk_norm: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if fused_input:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h if fused_input else h, qk_norm)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention_input(self, x: torch.Tensor, embedding: torch.Tensor | None = None) -> torch.Tensor:
        if embedding is None:
            return self.input_layernorm(x)
        return torch.cat([self.input_layernorm(embedding), self.hidden_norm(x)], -1)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual x + attention output [B, N, H], then the MLP block."""
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                past: KV | None = None, embedding: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """-> (layer output [B, N, H], the new rows' keys/values); see ``Attention.forward``."""
        out, kv = self.self_attn(self.attention_input(x, embedding), cos, sin, mask, past)
        return self.finish(x, out), kv
