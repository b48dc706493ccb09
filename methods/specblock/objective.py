"""SpecBlock's training objective (paper §3.3; docs/methods.md#specblock-training).

Every index j is a block-1 start (taps j, token x_{j+1}); slot k predicts x_{j+2+k} against the
target distribution p*_{j+1+k} over the draft vocabulary. Per slot:

    valid-prefix mask  m_0 = data mask,  m_{k+1} = m_k * [argmax p_k == argmax p*_k] * data mask
    draft loss         L_k = -(1/N_k) sum_j m_k sum_v p*(v) log p_k(v)   (or 1/N_0, see LossSettings.normalise)
    rank loss          CE(rank head, bucket of the target token's rank in p_k), masked by m

Cross-block training: for a random subset of indices (``cross_fraction``) a second block starts
at a uniformly drawn cut s in 1..K, conditioned on block 1's pre-norm h^L at slot s-1 (not
detached) with token x_{j+1+s}; it attends to block-1 keys of earlier positions and to block-1
slots 0..s-1 of its own position, exactly what a block-2 start sees at inference. Its mask
restarts (as the reference does). The rank loss switches on at ``rank_start`` steps; block 2 trains
from ``cross_block_start`` (paper: from the start; the reference ties it to the rank start).

Both block-1 conventions train (``SpecBlockConfig.bonus_row``, see model.py): ``once``
supervises each pair's own group of rows; ``duplicate`` runs the pairs as context rows and supervises
a copy of each pair one position later that sees the context rows up to its own pair (what the
authors' inference code drafts from). Block 2 then sees the context rows up to its anchor and the
anchor copy's slots 0..s-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from methods.layers import KV
from methods.specblock.model import NUM_BUCKETS, BlockOutput, SpecBlockModel, draft_row_offset, rank_to_bucket
from specbench.training.batch import TrainBatch


@dataclass
class LossSettings:
    valid_prefix: bool = True  # False: supervise every slot whatever came before (ablation)
    rank_start: int = 0  # training steps before the rank loss switches on (paper: 2,000)
    cross_block_start: int = 0  # steps before block 2 trains: paper 0 ("used throughout"); reference = rank_start
    cross_fraction: float = 0.25  # share of indices that also train a block-2 continuation
    decay: float = 1.0  # slot weight decay^k (paper: 1; reference README: 0.8)
    # "slot": eq. 6 exactly, L_k / N_k. "block": every slot's sum over N_0 (the block's real positions).
    # At the paper's batch (96 x 1024 tokens) N_k is large; at a CPU batch of a few conversations
    # N_3 is often a handful of positions whose loss then outweighs slot 0 and training stalls
    # (tiny-model test: slot-0 accuracy 0.12 vs 0.80 after 60 steps), so "block" is our default.
    normalise: str = "block"
    seed: int = 0


def block1_mask(groups: int, k: int, device=None) -> torch.Tensor:
    """[G*K, G*K] bool: row (j, a) sees every slot of positions < j and slots <= a of position j."""
    pos = torch.arange(groups * k, device=device) // k
    slot = torch.arange(groups * k, device=device) % k
    return (pos[None] < pos[:, None]) | ((pos[None] == pos[:, None]) & (slot[None] <= slot[:, None]))


def duplicate_mask(groups: int, k: int, device=None) -> torch.Tensor:
    """[2*G*K, 2*G*K] bool for the ``duplicate`` convention: G pairs' context rows (``block1_mask``
    among themselves), then G block-1 copies; copy j sees every context row of pairs <= j and its
    own slots <= a, no other copy."""
    pos = torch.arange(groups * k, device=device) // k
    slot = torch.arange(groups * k, device=device) % k
    own = (pos[None] == pos[:, None]) & (slot[None] <= slot[:, None])
    context = torch.cat([block1_mask(groups, k, device), torch.zeros_like(own)], 1)
    copies = torch.cat([pos[None] <= pos[:, None], own], 1)
    return torch.cat([context, copies], 0)


def block1_pass(model: SpecBlockModel, condition: torch.Tensor, tokens: torch.Tensor,
                bonus_row: str = "once") -> tuple[BlockOutput, list[KV]]:
    """Block 1 at every index j of T pairs (condition [B, T, 3H], tokens x_{j+1} [B, T]) in the given
    convention: the block-1 rows' output [B, T*K] (their keys/values in ``kv``), and every row's
    keys/values that a block 2 attends to (``once``: the same rows; ``duplicate``: the context rows,
    then the copies)."""
    b, t = tokens.shape
    k = model.K
    ids = torch.arange(t, device=tokens.device)[:, None] + 1 + torch.arange(k, device=tokens.device)
    if bonus_row == "once":
        out = model(condition, tokens, ids.reshape(1, -1).expand(b, -1), block1_mask(t, k, tokens.device))
        return out, out.kv
    positions = torch.cat([ids, ids + draft_row_offset(bonus_row)]).reshape(1, -1).expand(b, -1)
    out = model(torch.cat([condition, condition], 1), torch.cat([tokens, tokens], 1), positions,
                duplicate_mask(t, k, tokens.device), heads_from=t * k)
    every = out.kv
    out.kv = [(key[:, :, t * k:], value[:, :, t * k:]) for key, value in every]
    return out, every


def cross_block_mask(anchors: torch.Tensor, cuts: torch.Tensor, groups: int, k: int,
                     bonus_row: str = "once") -> torch.Tensor:
    """[B, A*K, R*K + A*K] bool for block-2 rows started at ``anchors`` [B, A] with cuts s [B, A] over
    ``block1_pass``'s rows (R = G once, 2G duplicate), then themselves: once, block-1 slots of earlier
    positions and slots 0..s-1 of the anchor; duplicate, the context rows of pairs <= the anchor and
    the anchor copy's slots 0..s-1; causal within itself."""
    device = anchors.device
    pos = torch.arange(groups * k, device=device) // k
    slot = torch.arange(groups * k, device=device) % k
    j = anchors.repeat_interleave(k, 1)[..., None]  # [B, A*K, 1]
    s = cuts.repeat_interleave(k, 1)[..., None]
    on_path = (pos == j) & (slot < s)
    if bonus_row == "once":
        old = (pos < j) | on_path
    else:
        old = torch.cat([(pos <= j).expand_as(on_path), on_path], -1)
    own = block1_mask(anchors.shape[1], k, device) & (
        (torch.arange(anchors.shape[1] * k, device=device) // k)[None] ==
        (torch.arange(anchors.shape[1] * k, device=device) // k)[:, None])
    return torch.cat([old, own.expand(anchors.shape[0], -1, -1)], -1)


def valid_prefix(agree: torch.Tensor, data_ok: torch.Tensor) -> torch.Tensor:
    """m [.., K]: slot k counts iff its data is real and every earlier slot of the block was right."""
    earlier_right = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], -1).long().cumprod(-1).bool()
    return data_ok & earlier_right


class SpecBlockLoss:
    """Callable for the shared Trainer; counts its own training steps to switch on the rank loss."""

    def __init__(self, model: SpecBlockModel, settings: LossSettings | None = None) -> None:
        self.model = model
        self.settings = settings or LossSettings()
        self.step = 0
        self.generator = torch.Generator().manual_seed(self.settings.seed)

    def __call__(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        training = torch.is_grad_enabled()
        full_objective = not training or self.step >= self.settings.rank_start
        cross_block = not training or self.step >= self.settings.cross_block_start
        if training:
            self.step += 1
        m, k = self.model, self.model.K
        in_vocab, restricted = batch.draft_vocab_targets(m.t2d)  # [B, T], [B, T, V_d]
        wanted = (batch.loss_mask > 0) & (batch.attention_mask > 0)
        b, t = batch.input_ids.shape
        device = batch.input_ids.device

        # ---- block 1 at every index ------------------------------------------------------
        slots = torch.arange(k, device=device)
        index = torch.arange(t, device=device)[:, None] + slots  # j + k
        tokens = F.pad(batch.input_ids[:, 1:], (0, 1))  # x_{j+1}
        out1, past = block1_pass(m, m.features(batch.taps), tokens, m.config.bonus_row)
        metrics: dict[str, float] = {}
        total, ranks = self._block_terms(out1, restricted, wanted, in_vocab, index.expand(b, -1, -1), full_objective,
                                         metrics, "")
        if full_objective:
            total = total + ranks
        if cross_block and self.settings.cross_fraction > 0:
            t2, r2 = self._block2(batch, out1, past, restricted, wanted, in_vocab, metrics, full_objective)
            total = total + t2 + r2
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _block2(self, batch, out1: BlockOutput, past: list[KV], restricted, wanted, in_vocab, metrics,
                with_rank: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = self.model, self.model.K
        b, t = batch.input_ids.shape
        device = batch.input_ids.device
        n_anchor = max(1, round(self.settings.cross_fraction * t))
        anchors = torch.randint(0, t, (b, n_anchor), generator=self.generator).to(device)
        cuts = torch.randint(1, k + 1, (b, n_anchor), generator=self.generator).to(device)
        h1 = out1.hidden.view(b, t, k, -1)
        condition = h1[torch.arange(b, device=device)[:, None], anchors, cuts - 1]  # [B, A, H]
        start_token = (anchors + cuts).clamp(max=t - 1)  # x_{j+1+s}
        tokens = batch.input_ids.gather(1, start_token)
        slots = torch.arange(k, device=device)
        bonus_row = m.config.bonus_row
        positions = (anchors[..., None] + 1 + draft_row_offset(bonus_row) + slots).reshape(b, -1)  # block 1's ids
        visible = cross_block_mask(anchors, cuts, t, k, bonus_row)
        out2 = m(condition, tokens, positions, visible, past=past)
        index = (anchors + cuts)[..., None] + slots  # target-logit index j+s+k for slot k
        ok = (anchors + cuts < t)[..., None]  # the start token exists
        return self._block_terms(out2, restricted, wanted, in_vocab, index, with_rank, metrics, "b2_", ok)

    def _block_terms(self, out: BlockOutput, restricted, wanted, in_vocab, index: torch.Tensor, with_rank: bool,
                     metrics: dict, prefix: str, extra_ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft and rank losses of G blocks whose slot k reads target index ``index`` [B, G, K]
        (p* at index + 1, predicted token at index + 2)."""
        k = self.model.K
        b, t = wanted.shape
        g = index.shape[1]
        p_idx = (index + 1).clamp(max=t - 1)
        tok_idx = (index + 2).clamp(max=t - 1)
        rows = torch.arange(b, device=index.device)[:, None, None]
        data_ok = (index + 2 < t) & wanted[rows, tok_idx] & in_vocab[rows, p_idx]
        if extra_ok is not None:
            data_ok = data_ok & extra_ok
        target_logits = restricted[rows, p_idx]  # [B, G, K, V_d]
        p_star = target_logits.softmax(-1)
        target = target_logits.argmax(-1)
        logits = out.logits.view(b, g, k, -1).float()
        logq = logits.log_softmax(-1)
        agree = logits.argmax(-1) == target
        m_valid = valid_prefix(agree, data_ok)
        m_loss = (m_valid if self.settings.valid_prefix else data_ok).float()
        ce = -(p_star * logq).sum(-1)
        total = logits.new_zeros(())
        for s in range(k):
            count = (m_loss[..., s] if self.settings.normalise == "slot" else data_ok[..., 0].float()).sum().clamp(min=1.0)
            total = total + self.settings.decay ** s * (ce[..., s] * m_loss[..., s]).sum() / count
            with torch.no_grad():
                n_valid = m_valid[..., s].float().sum().clamp(min=1.0)
                metrics[f"{prefix}acc_{s + 1}"] = float((agree[..., s] & m_valid[..., s]).float().sum() / n_valid)
        rank_loss = logits.new_zeros(())
        if with_rank:
            with torch.no_grad():
                rank = (logits > logits.gather(-1, target[..., None])).sum(-1) + 1
                bucket = rank_to_bucket(rank)
            rank_logits = out.rank_logits.view(b, g, k, -1).float()
            rank_ce = F.cross_entropy(rank_logits.reshape(-1, NUM_BUCKETS), bucket.reshape(-1), reduction="none")
            rank_loss = (rank_ce * m_loss.reshape(-1)).sum() / m_loss.sum().clamp(min=1.0)
            metrics[f"{prefix}rank_loss"] = float(rank_loss.detach())
            _bucket_counts(rank_logits.argmax(-1), bucket, m_valid, metrics, prefix)
        return total, rank_loss


def _bucket_counts(predicted: torch.Tensor, true: torch.Tensor, mask: torch.Tensor, metrics: dict, prefix: str) -> None:
    """Per-bucket true/predicted/hit counts over valid-prefix positions (the paper's Table 3);
    the Trainer averages them over eval batches, so ratios of them are exact."""
    for c in range(NUM_BUCKETS):
        is_true, is_pred = (true == c) & mask, (predicted == c) & mask
        metrics[f"{prefix}bucket{c}_true"] = float(is_true.sum())
        metrics[f"{prefix}bucket{c}_pred"] = float(is_pred.sum())
        metrics[f"{prefix}bucket{c}_hit"] = float((is_true & is_pred).sum())


def bucket_table(metrics: dict, prefix: str = "") -> list[dict]:
    """Frequency, precision, recall and F1 per bucket from ``_bucket_counts`` entries."""
    totals = sum(metrics.get(f"{prefix}bucket{c}_true", 0.0) for c in range(NUM_BUCKETS))
    rows = []
    for c in range(NUM_BUCKETS):
        true, pred, hit = (metrics.get(f"{prefix}bucket{c}_{x}", 0.0) for x in ("true", "pred", "hit"))
        precision = hit / pred if pred else 0.0
        recall = hit / true if true else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        rows.append({"bucket": c, "frequency": true / totals if totals else 0.0, "precision": precision,
                     "recall": recall, "f1": f1})
    return rows
