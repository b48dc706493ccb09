"""DVI — Draft, Verify & Improve: self-speculation with a draft head that learns while serving.

The target is split at layer ``layer`` (l). The drafter runs the target's own frozen layers
[0, l) on each token through the target's layer hook (``Target.run_layers``: their keys/values
go straight into the target's cache, exactly what the full model would write) and reads a LoRA head
off the layer-l state:  z_D = s * (W_0 + (alpha/r) B A) N_D(h_l),  W_0 = the frozen lm_head, N_D = the frozen
final RMSNorm, rank-r LoRA (A, B) and a scalar s the only trainable parameters (docs/methods.md#dvi;
the paper trains the LoRA factors only). A chain of ``k`` drafts plus the last draft's shallow pass is
verified by running only layers [l, L) on the stored states: the target keeps the rows ``run_layers`` ran
and its ``verify`` of exactly that chain finishes them with the remaining layers. The
verifier is the frozen full model and decoding is lossless: greedy drafts at T = 0, drafts sampled from softmax(z_D / T) with that q at T > 0.

Learning (``observe``): drafted positions up to and including the first rejection go into a
replay buffer as (N_D(h_l), W_0 N_D(h_l), verifier logits z_V, draft y, verifier token v,
reward r = accepted); every ``update_every`` verify calls one AdamW step runs, timed through the
engine's clock (``state.timer``) as the ``adapt`` phase (inside drafting time). Objectives (``objective``):

* ``kl-rl`` (DVI): lam_KL KL(p_V || p_D) + lam_RL (-sum r log p_D(y) / sum r) + lam_CE CE(p_D, v)
  on a buffer minibatch, plus, once past the warm-up, lam_RL (-(r - b) log p_D(y) + beta KL) on
  the fresh tuples of the last rollout (b = EMA of rewards). lam_KL = 1, lam_RL = 0 for
  ``warmup`` steps, then a linear ramp over ``ramp`` steps to lam_RL = 1, lam_KL = ``kl_min``;
  beta follows the same ramp from ``beta_start`` to ``beta_end``.
* ``kl``, ``pg``, ``ce``: the paper's single-objective ablations (online distillation only,
  REINFORCE with the EMA baseline only, reward-masked CE only).

The CE target is the verifier's token v (the reference logs the verifier's top-1 as ``token``):
CE on a rejected draft would teach the head its own mistake. The learnt head persists across the
prompts of a run (the runner keeps one drafter instance per side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.split_verify import check_split
from specbench.engine.target import Target, TargetOutput
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import draw, logits_to_probs

HEAD_FILE = "dvi_head.safetensors"
Objective = Literal["kl-rl", "kl", "pg", "ce"]


@dataclass
class DVIOptions:
    # Paper: 2 of 32. SmolLM2: acceptance is flat over 2..8, cost is not.
    layer: int = option(2, "Layers [0, layer) draft; the rest verify.", ge=1)
    k: int = option(4, "Drafts per verify call.", ge=1, tokens=True)
    learn: bool = option(True, "false = frozen head (a no-learning baseline).")
    objective: Objective = option("kl-rl", "kl-rl: KL then RL (DVI); kl, pg, ce: the paper's single-objective "
                                           "ablations (distillation, REINFORCE, reward-masked CE).")
    lr: float = option(5e-4, "AdamW learning rate of the LoRA head.", ge=0)
    weight_decay: float = option(0.01, "AdamW weight decay.", ge=0)
    rank: int = option(8, "LoRA rank.", ge=1)
    alpha: float = option(16.0, "LoRA alpha (scale alpha / rank).", ge=0)
    dropout: float = option(0.05, "LoRA dropout.", ge=0, lt=1)
    buffer: int = option(2048, "Replay buffer capacity (tuples).", ge=1)
    batch: int = option(32, "Minibatch per improve step.", ge=1)
    update_every: int = option(1, "Verify calls per improve step (1 = one step per rollout).", ge=1)
    warmup: int = option(40, "KL-only steps.", ge=0)
    ramp: int = option(80, "Steps from KL to RL.", ge=0)
    kl_min: float = option(0.05, "KL weight after the ramp.", ge=0)
    ce_weight: float = option(0.1, "Cross-entropy weight.", ge=0)
    beta_start: float = option(0.5, "KL weight inside the on-policy term, at the start of the ramp.", ge=0)
    beta_end: float = option(0.05, "KL weight inside the on-policy term, after the ramp.", ge=0)
    baseline_ema: float = option(0.9, "Decay of the reward baseline's moving average.", ge=0, le=1)
    clip: float = option(1.0, "Gradient-norm clip.", ge=0)
    head: str = option("", "Folder with a saved head (warm start); empty = fresh LoRA (B = 0: the plain early exit).")
    seed: int = option(0, "Seed of the LoRA init, its dropout and the replay sampling.", ge=0)


# ---- schedule and losses: pure functions -----------------------------------------------------
@dataclass(frozen=True)
class Weights:
    kl: float
    rl: float  # reward-masked CE on the buffer, and the on-policy term's weight
    ce: float
    beta: float  # KL weight inside the on-policy term


def schedule(step: int, o: DVIOptions) -> Weights:
    """Loss weights at improve step ``step`` (0-based) for ``o.objective``."""
    if o.objective == "kl":
        return Weights(1.0, 0.0, 0.0, 0.0)
    if o.objective == "ce":
        return Weights(0.0, 1.0, 0.0, 0.0)
    if o.objective == "pg":
        return Weights(0.0, 1.0, 0.0, 0.0)
    t = 0.0 if step < o.warmup else min(1.0, (step - o.warmup + 1) / max(o.ramp, 1))
    return Weights(kl=(1 - t) + t * o.kl_min, rl=t, ce=o.ce_weight, beta=o.beta_start + t * (o.beta_end - o.beta_start))


def kl_to(verifier_logits: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(z_V) || q)."""
    log_p = F.log_softmax(verifier_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def reward_masked_ce(log_q: torch.Tensor, drafts: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """-sum_j r_j log q(y_j) / sum_j r_j: credit only where the verifier accepted."""
    picked = log_q.gather(1, drafts[:, None])[:, 0]
    return -(rewards * picked).sum() / rewards.sum().clamp_min(1.0)


def reinforce(log_q: torch.Tensor, drafts: torch.Tensor, rewards: torch.Tensor, baseline: float) -> torch.Tensor:
    """On-policy REINFORCE with a constant baseline: -mean (r - b) log q(y)."""
    picked = log_q.gather(1, drafts[:, None])[:, 0]
    return -((rewards - baseline) * picked).mean()


# ---- the draft head ----------------------------------------------------------------------------
class DraftHead(nn.Module):
    """z_D = s * (W_0 x + (alpha/r) B A drop(x)), x = N_D(h). W_0 and N_D are the target's frozen
    lm_head and final norm (shared, not copied: frozen, so identical and half the memory); only
    A, B and s train, in fp32. B starts at zero, so the fresh head is the plain early exit."""

    def __init__(self, lm_head: nn.Module, norm: nn.Module, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.frozen = [lm_head, norm]  # a list keeps them out of this module's parameters
        hidden, vocab = lm_head.weight.shape[1], lm_head.weight.shape[0]
        self.lora_A = nn.Parameter(torch.empty(rank, hidden))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_B = nn.Parameter(torch.zeros(vocab, rank))
        self.scale = nn.Parameter(torch.ones(()))
        self.factor, self.dropout, self.gen = alpha / rank, dropout, generator

    @torch.no_grad()
    def features(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x = N_D(h) in fp32, base logits W_0 x in the target dtype) for [n, H] states."""
        lm_head, norm = self.frozen
        x = norm(h)
        return x.float(), lm_head(x)

    def logits(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits from cached features; LoRA dropout only in training mode."""
        if self.training and self.dropout > 0:
            keep = (torch.rand(x.shape, generator=self.gen) >= self.dropout).to(x.device)
            x = x * keep / (1 - self.dropout)
        delta = (x @ self.lora_A.T) @ self.lora_B.T
        return self.scale * (base.float() + self.factor * delta)

    def trainable(self) -> dict[str, torch.Tensor]:
        return {"lora_A": self.lora_A, "lora_B": self.lora_B, "scale": self.scale}


# ---- replay buffer -----------------------------------------------------------------------------
class ReplayBuffer:
    """Ring buffer of logged draft positions. Storage grows geometrically up to ``capacity`` (a
    full SmolLM2 buffer holds two vocabulary-wide rows per tuple, ~400 MB in bf16)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.size, self.next = capacity, 0, 0
        self.data: dict[str, torch.Tensor] = {}

    def _reserve(self, rows: dict[str, torch.Tensor], needed: int) -> None:
        have = next(iter(self.data.values())).shape[0] if self.data else 0
        if needed <= have or have == self.capacity:
            return
        size = min(self.capacity, max(needed, 2 * have, 64))
        grown = {k: torch.empty((size, *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in rows.items()}
        for k, v in self.data.items():
            grown[k][:have] = v
        self.data = grown

    def push(self, rows: dict[str, torch.Tensor]) -> None:
        n = rows["x"].shape[0]
        self._reserve(rows, self.next + n)
        idx = (torch.arange(n) + self.next) % self.capacity
        for k, v in rows.items():
            self.data[k][idx.to(v.device)] = v
        self.next = (self.next + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, self.size, (min(n, self.size),), generator=generator)
        return {k: v[idx.to(v.device)] for k, v in self.data.items()}

    def __len__(self) -> int:
        return self.size


def _cat_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


# ---- the drafter -------------------------------------------------------------------------------
class DVIDrafter(Drafter):
    name = "dvi"
    label = "DVI"
    Options = DVIOptions
    learns = True
    weight_options = ("head",)

    def __init__(self, options: DVIOptions | None = None) -> None:
        super().__init__(options)
        self.learns = self.options.learn  # a frozen head may take the runner's warm-up

    def batch_refusal(self) -> str | None:
        # Even frozen, it drafts through the target's own first layers over the target's one-request cache,
        # which a batch does not keep per request (the batched verify owns the requests' caches).
        return super().batch_refusal() or ("drafts with the target's first layers over the target's one-request "
                                           "cache, which a batch does not keep per request; run it with "
                                           "--batch-size 1")

    def setup(self, target: Target) -> None:
        super().setup(target)
        o = self.options
        check_split(target, o.layer)  # one-line error for an unsupported target or a layer out of range
        self.gen = torch.Generator().manual_seed(o.seed)
        head_out = target.model.get_output_embeddings()
        self.head = DraftHead(head_out, target.model.model.norm, o.rank, o.alpha, o.dropout, self.gen)
        self.head.to(target.device)
        if o.head:
            self.load_head(self.resolve_weights("head"))
        params = self.head.trainable()
        self.optimizer = torch.optim.AdamW(
            [{"params": [params["lora_A"], params["lora_B"]], "weight_decay": o.weight_decay},
             {"params": [params["scale"]], "weight_decay": 0.0}], lr=o.lr, betas=(0.9, 0.999))
        self.buffer = ReplayBuffer(o.buffer)
        self.steps = 0
        self.baseline = 0.0  # EMA of on-policy rewards
        self.calls = 0
        self.fresh: list[dict[str, torch.Tensor]] = []
        self.last: dict = {}

    # ---- per turn ---------------------------------------------------------------------------
    def begin(self, state: DecodeState, prefill: TargetOutput) -> None:
        self.turn = {"steps": 0, "logged": 0, "accepted": 0}
        self.fresh = []

    def end(self, state: DecodeState) -> dict:
        w = schedule(self.steps, self.options)
        adapt_s = state.timer.seconds().get("adapt", 0.0)  # the engine's clock: this turn's updates
        return {"update_steps": self.steps, "update_steps_turn": self.turn["steps"],
                "adapt_s_turn": round(adapt_s, 6), "lam_kl": w.kl, "lam_rl": w.rl, "lam_ce": w.ce,
                "beta": w.beta, "buffer": len(self.buffer), "batch_acceptance": self.last.get("batch_acceptance"),
                "turn_acceptance": self.turn["accepted"] / max(self.turn["logged"], 1),  # reward rate of logged drafts
                "reward_baseline": round(self.baseline, 4), "loss": self.last.get("loss"), "layer": self.options.layer,
                "objective": self.options.objective}

    # ---- draft --------------------------------------------------------------------------------
    def propose(self, state: DecodeState) -> DraftTree:
        o = self.options
        feed = state.bonus
        xs, bases, drafts, qs = [], [], [], []
        for _ in range(o.k):
            h = self.target.run_layers([feed], o.layer, state.timer)
            x, base = self.head.features(h)
            with torch.no_grad():
                logits = self.head.logits(x, base)[0]
            if state.params.greedy:
                feed = int(logits.argmax())
            else:  # q is exactly the distribution the draft is drawn from
                q = logits_to_probs(logits.unsqueeze(0), state.params)[0]
                feed = draw(q, state.generator)
                qs.append(q)
            xs.append(x)
            bases.append(base)
            drafts.append(feed)
        self.target.run_layers([feed], o.layer, state.timer)  # the last draft's pass: its row yields the bonus
        self.pending = (torch.cat(xs), torch.cat(bases), torch.tensor(drafts, device=self.target.device))
        if qs:
            return DraftTree.chain(drafts, q=torch.stack(qs), kind=SiblingKind.SAMPLED_IID)
        return DraftTree.chain(drafts)

    # ---- improve ------------------------------------------------------------------------------
    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        accepted = len(result.accepted)
        logged = min(accepted + 1, self.options.k)  # up to and including the first rejection
        x, base, drafts = self.pending
        rows = {"x": x[:logged], "base": base[:logged], "z_v": result.logits[:logged].to(base.dtype),
                "draft": drafts[:logged], "verifier": torch.tensor(result.committed[:logged], device=base.device),
                "reward": (torch.arange(logged, device=base.device) < accepted).float()}
        self.turn["logged"] += logged
        self.turn["accepted"] += accepted
        if not self.options.learn:
            return
        rows = {k: v.clone() for k, v in rows.items()}  # out of inference mode, so autograd may use them
        self.buffer.push(rows)
        self.fresh.append(rows)
        self.calls += 1
        if self.calls % self.options.update_every == 0:
            with state.timer.phase("adapt"):
                self.improve(_cat_rows(self.fresh))
            self.fresh = []
            self.turn["steps"] += 1

    def improve(self, fresh: dict[str, torch.Tensor]) -> dict:
        """One optimiser step on a buffer minibatch plus the fresh on-policy tuples."""
        o, w = self.options, schedule(self.steps, self.options)
        batch = self.buffer.sample(o.batch, self.gen)
        self.head.train()
        loss = torch.zeros((), device=self.target.device)
        terms: dict[str, float] = {}
        if w.kl or w.ce or (w.rl and o.objective != "pg"):
            log_q = F.log_softmax(self.head.logits(batch["x"], batch["base"]), -1)
            parts = {"kl": (w.kl, lambda: kl_to(batch["z_v"], log_q)),
                     "rmce": (w.rl if o.objective != "pg" else 0.0,
                              lambda: reward_masked_ce(log_q, batch["draft"], batch["reward"])),
                     "ce": (w.ce, lambda: F.nll_loss(log_q, batch["verifier"]))}
            for name, (weight, fn) in parts.items():
                if weight:
                    value = fn()
                    terms[name] = float(value.detach())
                    loss = loss + weight * value
        # The reward baseline tracks every rollout, so it is warm when the on-policy term starts.
        self.baseline = o.baseline_ema * self.baseline + (1 - o.baseline_ema) * float(fresh["reward"].mean())
        if w.rl and o.objective in ("kl-rl", "pg"):
            loss = loss + w.rl * self._on_policy(fresh, w.beta, terms)
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(self.head.trainable().values()), o.clip)
            self.optimizer.step()
        self.head.eval()
        self.steps += 1
        self.last = {"loss": round(float(loss.detach()), 5),
                     "batch_acceptance": round(float(batch["reward"].mean()), 4), **terms}
        return self.last

    def _on_policy(self, fresh: dict[str, torch.Tensor], beta: float, terms: dict) -> torch.Tensor:
        """REINFORCE on the last rollout's tuples (accepted and first-rejected drafts) with an EMA
        reward baseline, plus beta * KL to the verifier to keep the head calibrated."""
        log_q = F.log_softmax(self.head.logits(fresh["x"], fresh["base"]), -1)
        pg = reinforce(log_q, fresh["draft"], fresh["reward"], self.baseline)
        terms["pg"] = float(pg.detach())
        if beta:
            kl = kl_to(fresh["z_v"], log_q)
            terms["pg_kl"] = float(kl.detach())
            return pg + beta * kl
        return pg

    # ---- persistence (warm start) -------------------------------------------------------------
    def save_head(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.head.trainable().items()}
        save_file(tensors, str(folder / HEAD_FILE), metadata={"layer": str(self.options.layer),
                                                            "rank": str(self.options.rank)})
        return folder / HEAD_FILE

    def load_head(self, folder: str | Path) -> None:
        from safetensors import safe_open

        path = Path(folder) / HEAD_FILE
        if not path.is_file():
            raise SpecbenchError(f"dvi: no {HEAD_FILE} in {folder}; pass a folder written by save_head")
        with safe_open(str(path), "pt") as f:
            layer = int(f.metadata().get("layer", -1))
            if layer != self.options.layer:
                raise SpecbenchError(f"dvi: the head in {folder} was trained at layer {layer}, "
                                     f"not {self.options.layer}")
            for name, param in self.head.trainable().items():
                value = f.get_tensor(name)
                if value.shape != param.shape:
                    raise SpecbenchError(f"dvi: {name} in {folder} has shape {tuple(value.shape)}, "
                                         f"expected {tuple(param.shape)} (another target or rank)")
                with torch.no_grad():
                    param.copy_(value)


# ---- the paper's single-objective ablations (Table 3) -----------------------------------------
@dataclass
class DVIKLOptions(DVIOptions):
    objective: Objective = "kl"


@dataclass
class DVIPGOptions(DVIOptions):
    objective: Objective = "pg"


@dataclass
class DVICEOptions(DVIOptions):
    objective: Objective = "ce"


class DVIKLDrafter(DVIDrafter):
    """Online distillation only: KL(p_V || p_D) on the replay buffer."""

    name = "dvi-kl"
    label = "DVI (KL only)"
    family = "dvi"
    ablation_of = "dvi"
    Options = DVIKLOptions


class DVIPGDrafter(DVIDrafter):
    """On-policy REINFORCE only (EMA-0.9 baseline, no KL anchor)."""

    name = "dvi-pg"
    label = "DVI (PG only)"
    family = "dvi"
    ablation_of = "dvi"
    Options = DVIPGOptions


class DVICEDrafter(DVIDrafter):
    """Reward-masked cross-entropy only (credit on accepted drafts)."""

    name = "dvi-ce"
    label = "DVI (CE only)"
    family = "dvi"
    ablation_of = "dvi"
    Options = DVICEOptions
