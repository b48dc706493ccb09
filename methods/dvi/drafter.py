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

from pathlib import Path

import torch
import torch.nn.functional as F

from methods.dvi.head import HEAD_FILE, DraftHead
from methods.dvi.objectives import kl_to, reinforce, reward_masked_ce, schedule
from methods.dvi.options import DVICEOptions, DVIKLOptions, DVIOptions, DVIPGOptions
from methods.dvi.replay import ReplayBuffer, cat_rows
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.engine.split_verify import check_split
from specbench.engine.target import Target, TargetOutput
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.engine.verify import draw, logits_to_probs


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
                self.improve(cat_rows(self.fresh))
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
