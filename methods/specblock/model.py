"""The SpecBlock drafter network (paper §3.1-3.2; docs/methods.md#specblock-drafter).

One forward turns G start points into G blocks of K dependent slots:

    slot input  h0[g, k] = W_fuse [norm(c_g); norm(embed(x_g)); norm(q_k)]      (prefix broadcast)
    layer l>0   h[g, k] <- W_shift^(l) [h[g, k]; h[g, k-1]]   (h[g, -1] := h[g, 0])  (layer-wise shift)
    heads       p = softmax(lm_head(norm(h^L))),  bucket = rank_head(sg(norm(h^L)), sg(psi(p)))

``c_g`` is W_cond over three target taps for a committed position, or the drafter's own pre-norm
last-layer state h^L for a cross-block start (W_cond bypassed). Rows are laid out group-major
(row = g*K + k); attention is given as an explicit boolean mask so that training (all positions
at once) and inference (cache + tree starts) share one code path.

Block 1 reads the last committed pair (taps j, token j+1) in one of two conventions
(``SpecBlockConfig.bonus_row``, what the drafter was trained with):

* ``once`` (ours, the paper's): every committed pair is one group of K rows at rotary ids j+1..j+K,
  attending to the earlier pairs' rows; the last pair's group *is* block 1 and stays in the cache.
* ``duplicate`` (the authors' inference code): the committed pairs are context rows as above, and
  block 1 is a second copy of the last pair one position later (ids j+2..j+K+1), attending to every
  context row, the last pair's included; the copy is transient, like a block-2 start.

Module names follow the published SpecBlock checkpoints (``input_layer.*``, ``layers.N.*``,
``shift_proj.N``, ``norm``, ``lm_head``, ``rank_head.0/2``), so both formats share one state dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from methods.layers import KV, DecoderLayer, LayerShapes, RMSNorm, Rotary, target_layer_shapes
from specbench.errors import SpecbenchError

RANK_FEATURES = 15  # top-10 log-probs, 3 logit gaps, top-1 probability, entropy
RANK_TOPK = 20  # log-sum-exp over the top-20 logits, in training and inference alike
BUCKET_EDGES = (1, 4, 10)  # rank 1 | 2-4 | 5-10 | >10  ->  buckets 0, 1, 2, 3
NUM_BUCKETS = 4
BONUS_ROWS = ("once", "duplicate")  # block 1's reading of the last committed pair (module docstring)


@dataclass
class SpecBlockConfig(LayerShapes):
    draft_vocab_size: int
    block_size: int = 4  # K
    num_layers: int = 2
    prefix_broadcast: bool = True  # False: only slot 0 receives c and the token embedding (ablation)
    layer_shift: bool = True  # False: no W_shift between layers (ablation)
    rank_hidden: int = 256  # width of the rank head's MLP (the paper leaves it open)
    # The block-1 convention the drafter was trained with (module docstring); checkpoints saved before
    # the field existed were trained "once".
    bonus_row: str = "once"

    def __post_init__(self) -> None:
        if self.bonus_row not in BONUS_ROWS:
            raise SpecbenchError(f"SpecBlock bonus_row must be one of {', '.join(BONUS_ROWS)} (got {self.bonus_row!r})")

    @classmethod
    def from_target(cls, target, draft_vocab: int, **overrides) -> "SpecBlockConfig":
        return cls(**target_layer_shapes(target), draft_vocab_size=draft_vocab, **overrides)


def draft_row_offset(bonus_row: str) -> int:
    """Block 1's rotary ids start ``j + 1 + offset`` for the last committed pair j (module docstring)."""
    return BONUS_ROWS.index(bonus_row)


def rank_features(logits: torch.Tensor) -> torch.Tensor:
    """psi(p) [..., 15] from draft logits [..., V_d] (App. B), normalised over the top-20 logits."""
    top = logits.detach().float().topk(RANK_TOPK, dim=-1).values
    lse = top.logsumexp(-1, keepdim=True)
    log_p = top - lse
    gaps = top[..., :1] - top[..., [1, 2, 4]]  # raw-logit gaps to ranks 2, 3 and 5
    entropy = -(log_p.exp() * log_p).sum(-1, keepdim=True)
    return torch.cat([log_p[..., :10], gaps, log_p[..., :1].exp(), entropy], -1)


def rank_to_bucket(rank: torch.Tensor) -> torch.Tensor:
    """1-based rank -> bucket 0..3."""
    return torch.bucketize(rank, torch.tensor(BUCKET_EDGES, device=rank.device), right=False)


class InputLayer(nn.Module):
    """Fuses condition, token embedding and the K position queries into K slot inputs."""

    def __init__(self, cfg: SpecBlockConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.condition_proj = nn.Linear(3 * h, h, bias=False)  # W_cond
        self.condition_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.token_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.position_queries = nn.Embedding(cfg.block_size, h)
        nn.init.normal_(self.position_queries.weight, std=0.02)
        self.query_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fuse = nn.Linear(3 * h, h, bias=False)  # W_fuse
        self.broadcast = cfg.prefix_broadcast

    def forward(self, condition: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """condition [B, G, 3H] (target taps) or [B, G, H] (own h^L); token_emb [B, G, H] -> [B, G*K, H]."""
        h = token_emb.shape[-1]
        c = condition if condition.shape[-1] == h else self.condition_proj(condition)
        w = self.fuse.weight  # [H, 3H]: apply the three column blocks separately, no [.., K, 3H] concat
        shared = F.linear(self.condition_norm(c), w[:, :h]) + F.linear(self.token_norm(token_emb), w[:, h:2 * h])
        queries = F.linear(self.query_norm(self.position_queries.weight), w[:, 2 * h:])  # [K, H]
        shared = shared[:, :, None, :]
        if not self.broadcast:  # ablation: slots k > 0 see the prefix only through attention
            only_first = torch.zeros(queries.shape[0], 1, dtype=shared.dtype, device=shared.device)
            only_first[0] = 1
            shared = shared * only_first
        out = shared + queries
        b, g, k, _ = out.shape
        return out.reshape(b, g * k, h)


@dataclass
class BlockOutput:
    hidden: torch.Tensor  # [B, N, H] pre-norm last-layer state h^L (the next blocks' condition)
    logits: torch.Tensor  # [B, N, V_d]
    rank_logits: torch.Tensor  # [B, N, 4]
    kv: list[KV]  # per layer, keys/values of the N new rows


def identity_shift(hidden: int) -> nn.Linear:
    """W_shift = [I, 0]: a new drafter starts as the no-shift network and learns what to take from slot k-1.
    The paper gives no initialisation. nn.Linear's random one squeezes the residual stream through a badly
    conditioned random map that a short run never undoes (SmolLM2's one-epoch W_shift ended at its init's
    norm, and the no-shift ablation beat it at every depth). No RNG draw: the other weights match the
    no-shift network of the same seed."""
    proj = nn.utils.skip_init(nn.Linear, 2 * hidden, hidden, bias=False)
    with torch.no_grad():
        proj.weight.zero_()
        proj.weight[:, :hidden].copy_(torch.eye(hidden))
    return proj


class SpecBlockModel(nn.Module):
    """The drafter. The token embedding is the target's, frozen and referenced (not saved)."""

    def __init__(self, config: SpecBlockConfig, taps: tuple[int, ...], embedding: nn.Module | None = None) -> None:
        super().__init__()
        if config.draft_vocab_size < RANK_TOPK:
            raise SpecbenchError(f"SpecBlock's rank features need a draft vocabulary of >= {RANK_TOPK} tokens "
                                 f"(got {config.draft_vocab_size})")
        self.config = config
        self.taps = tuple(taps)
        h = config.hidden_size
        self.input_layer = InputLayer(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        n_shift = config.num_layers - 1 if config.layer_shift else 0
        self.shift_proj = nn.ModuleList(identity_shift(h) for _ in range(n_shift))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rank_head = nn.Sequential(nn.Linear(h + RANK_FEATURES, config.rank_hidden, bias=False), nn.SiLU(),
                                       nn.Linear(config.rank_hidden, NUM_BUCKETS, bias=False))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.rotary = Rotary(config)
        self._embedding: tuple[nn.Module, ...] = ()
        if embedding is not None:
            self._embedding = (embedding,)  # a tuple keeps it out of parameters() and state_dict()

    @property
    def K(self) -> int:
        return self.config.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def attach_embedding(self, embedding: nn.Module) -> None:
        self._embedding = (embedding,)

    def embed(self, target_ids: torch.Tensor) -> torch.Tensor:
        if not self._embedding:
            raise RuntimeError("SpecBlockModel has no token embedding; call attach_embedding(target embedding)")
        with torch.no_grad():
            return self._embedding[0](target_ids).to(self.dtype)

    def features(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([taps[i] for i in self.taps], -1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_index(self) -> torch.Tensor:
        """[V] target id -> draft id (-1 outside the draft vocabulary)."""
        index = torch.full_like(self.d2t.new_empty(self.config.vocab_size), -1)
        members = self.t2d.nonzero().squeeze(-1)
        index[members] = torch.arange(members.numel(), device=members.device)
        return index

    def _shift(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Slot k's state mixed with slot k-1's of the same block (slot 0 with itself)."""
        b, n, h = x.shape
        blocks = x.view(b, n // self.K, self.K, h)
        prev = torch.cat([blocks[:, :, :1], blocks[:, :, :-1]], 2).reshape(b, n, h)
        w = self.shift_proj[layer].weight
        return F.linear(x, w[:, :h]) + F.linear(prev, w[:, h:])

    def forward(self, condition: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor, past: list[KV] | None = None, heads_from: int = 0) -> BlockOutput:
        """G blocks in one pass.

        condition [B, G, 3H | H]; token_ids [B, G] target ids; positions [B, G*K] rotary ids;
        visible [B?, G*K, S + G*K] bool (True = attend) over ``past`` rows (S per layer) then the
        new rows. Returns per-row outputs and the new rows' keys/values (not concatenated to past);
        ``heads_from`` > 0 returns hidden states, logits and rank logits of the rows from there on only
        (context rows whose keys/values are all that is read), keys/values of every new row."""
        x = self.input_layer(condition.to(self.dtype), self.embed(token_ids))
        cos, sin = self.rotary(positions, x.dtype)
        kv: list[KV] = []
        for i, layer in enumerate(self.layers):
            if i > 0 and self.shift_proj:
                x = self._shift(x, i - 1)
            x, layer_kv = layer(x, cos, sin, visible, None if past is None else past[i])
            kv.append(layer_kv)
        x = x[:, heads_from:] if heads_from else x
        normed = self.norm(x)
        logits = self.lm_head(normed)
        rank_in = torch.cat([normed.detach(), rank_features(logits).to(normed.dtype)], -1)
        return BlockOutput(x, logits, self.rank_head(rank_in), kv)
