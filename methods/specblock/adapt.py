"""Serving-time adaptation of the SpecBlock drafter: ``specblock-adapt`` (the cost-aware bandit of
paper §3.4 / App. A.3) and ``specblock-osd`` (always-update baseline; docs/methods.md#specblock-serving-time-adaptation).

Signal. At each verify call, the first block-1 slot d whose greedy token the target did not
commit is a rejection point; with r = the drafter's probability of the committed token there,
a query's signal is s = sum(1 - r). Each point keeps what an update needs: RMSNorm(h^L) of the slot,
the target's distribution at that row (restricted to the draft vocabulary), the token's rank bucket,
and (for full updates) where in the query's sequence the slot sits.

Bandit (+adapt). Actions skip / head (lm_head + rank head) / full (everything but the frozen
embedding); values v_head, v_full (EWMA of realised tokens/s gain per unit of signal) start at 0.
10 warm-up queries; then the first 8 training events are epsilon-greedy over {head, full}
(epsilon 0.3 -> 0.1, never skip); afterwards argmax_a s * v_a, skip if both <= 0. The chosen
action's buffer collects the query's points; when it holds 8 queries, one AdamW step (lr 5e-5,
clip 0.5) on the training copy with soft CE + rank CE + 0.01 * KL(p_theta || p_theta0), then the
inference copy is synced. The two queries after an event cannot trigger one. Over the next 8
queries the gain over the 8 before updates v_a when s_trig >= 5. Fail-safe: if mean tau falls over
3 consecutive 8-query intervals, restore the last snapshot taken at a non-falling interval and reset
the values. Updates run at the start of the next query's first propose, timed through the engine's
clock (``state.timer``) as ``adapt`` (part of drafting time), so a query's record shows the cost of
the update it paid for; a query's throughput for the bandit is its decode time on the same clock.

OSD. Every query's points are logged; every 8 queries one full-drafter step of forward KL (soft
CE) at those points, lr 1e-4, no bandit, no KL to theta0.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions
from methods.specblock.model import SpecBlockModel, rank_features, rank_to_bucket
from methods.specblock.objective import block1_pass
from specbench.engine.drafter import DecodeState, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target, TargetOutput

ACTIONS = ("skip", "head", "full")


@dataclass
class AdaptOptions(SpecBlockOptions):
    warmup_queries: int = option(10, "Warm-up queries before the first update event.", ge=0)
    cold_start_events: int = option(8, "First update events chosen epsilon-greedily over head and full.", ge=0)
    epsilon: list[float] = option([0.3, 0.1], "Exploration rate, linear from the first to the second value over the "
                                              "cold-start events.", ge=0, le=1)
    buffer_queries: int = option(8, "Queries an action's buffer collects before its update step.", ge=0)
    value_window: int = option(8, "Queries before/after an event compared for the realised gain (and the "
                                  "fail-safe's interval).", ge=1)
    cooldown: int = option(2, "Queries after an event that cannot trigger another.", ge=0)
    s_min: float = option(5.0, "Least signal of an event whose realised gain updates the values.", ge=0)
    ewma: float = option(0.9, "EWMA decay of the actions' values.", ge=0, le=1)
    kl_weight: float = option(0.01, "Weight of the KL to the pre-deployment drafter.", ge=0)
    lr: float = option(5e-5, "AdamW learning rate of the updates.", ge=0)
    grad_clip: float = option(0.5, "Gradient-norm clip.", ge=0)
    rollback_intervals: int = option(3, "Consecutive intervals of falling tau before the fail-safe restores a "
                                        "snapshot.", ge=0)
    seed: int = option(0, "Seed of the exploration draws.", ge=0)

    def check(self, owner: str) -> None:
        super().check(owner)
        if not self.epsilon:
            raise SpecbenchError(f"{owner}: epsilon needs one or two rates (start,end), e.g. 0.3,0.1")


@dataclass
class RejectionPoint:
    normed: torch.Tensor  # [H] RMSNorm(h^L) of the slot (fp32)
    target: torch.Tensor  # [V_d] target distribution at that row, restricted to the draft vocabulary
    bucket: int  # rank bucket of the committed token in the slot's draft distribution
    position: int  # committed index j of the slot's block-1 start
    slot: int


@dataclass
class QueryLog:
    points: list[RejectionPoint] = field(default_factory=list)
    signal: float = 0.0
    features: list[torch.Tensor] = field(default_factory=list)  # block-1 conditions in order (taps rows)
    tokens: list[int] = field(default_factory=list)


def choose_action(values: dict[str, float], signal: float, cold_start: bool, epsilon: float,
                  rng: random.Random) -> str:
    """The bandit's decision for one query (pure, so it can be tested)."""
    if cold_start:
        if rng.random() < epsilon:
            return rng.choice(["head", "full"])
        return "head" if values["head"] >= values["full"] else "full"
    gains = {a: signal * values[a] for a in ("head", "full")}
    best = max(gains, key=gains.get)
    return best if gains[best] > 0 else "skip"


def kl_to_reference(logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(p_theta || p_theta0) over rows."""
    logp, logp0 = logits.float().log_softmax(-1), reference_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - logp0)).sum(-1).mean()


def head_parameters(model: SpecBlockModel) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.startswith(("lm_head.", "rank_head."))]


class SpecBlockAdaptDrafter(SpecBlockDrafter):
    name = "specblock-adapt"
    label = "SpecBlock+adapt"
    family = "specblock"
    Options = AdaptOptions
    weights_name = "specblock"
    learns = True
    bandit = True  # False: OSD's always-update schedule

    # ---- lifecycle ------------------------------------------------------------------------
    def setup(self, target: Target) -> None:
        super().setup(target)
        o = self.options
        self.train_model = copy.deepcopy(self.model).float().train()  # updates in fp32, synced into self.model
        self.train_model.attach_embedding(self.target.model.get_input_embeddings())
        self.reference = copy.deepcopy(self.train_model).eval().requires_grad_(False)  # theta0
        self.optimizer = torch.optim.AdamW(self.train_model.parameters(), lr=o.lr)
        self.values = {"head": 0.0, "full": 0.0}
        self.buffers: dict[str, list[QueryLog]] = {"head": [], "full": []}
        self.rng = random.Random(o.seed)
        self.queries = 0
        self.events = 0
        self.cooldown_left = 0
        self.throughput: list[float] = []
        self.taus: list[float] = []
        self.pending_values: list[dict] = []  # events still collecting post-update throughput
        self.scheduled: str | None = None  # action whose buffer is full: update at the next propose
        self.snapshot = self._state()
        self.interval_taus: list[float] = []

    def begin(self, state: DecodeState, prefill: TargetOutput) -> None:
        super().begin(state, prefill)
        self.log = QueryLog()
        self.turn_stats = {"action": "skip", "update": None, "adapt_s": 0.0, "rollback": False}
        self.committed_calls = [0, 0]  # committed tokens, verify calls

    def _encode(self, state: DecodeState):
        self.log.features.append(self.pending.float().cpu())
        return super()._encode(state)

    def propose(self, state: DecodeState):
        if self.scheduled is not None:
            with state.timer.phase("adapt"):
                self._update(self.scheduled)
            self.scheduled = None
        return super().propose(state)

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        super().observe(state, result)
        self.committed_calls[0] += len(result.committed)
        self.committed_calls[1] += 1
        chain = self._chain
        greedy = [int(chain.logits[k].argmax()) for k in range(len(chain.buckets))]
        miss = chain.first_miss(result, [int(self.model.to_target_ids(torch.tensor(g))) for g in greedy])
        if miss is None:
            return
        token = result.committed[miss]
        draft_id = int(self.draft_index[token])
        probs = chain.logits[miss].softmax(-1)
        r = float(probs[draft_id]) if draft_id >= 0 else 0.0
        self.log.signal += 1.0 - r
        if draft_id < 0:
            return  # the token cannot be drafted: nothing to learn at this point
        parent_row = 0 if miss == 0 else chain.tree_index[chain.nodes[miss - 1]] + 1
        target = result.logits[parent_row].float()[self.model.t2d].softmax(-1).cpu()
        bucket = int(rank_to_bucket((chain.logits[miss] > chain.logits[miss, draft_id]).sum() + 1))
        self.log.points.append(RejectionPoint(chain.hidden[miss], target, bucket, chain.position, miss))

    def end(self, state: DecodeState) -> dict:
        self.log.tokens = list(state.tokens)
        elapsed = state.timer.elapsed(exclude=("prefill",))  # this query's decode time, on the engine's clock
        if self.turn_stats["update"] is not None:
            self.turn_stats["adapt_s"] = round(state.timer.seconds().get("adapt", 0.0), 4)
        self.throughput.append((len(state.tokens) - state.prompt_len) / max(elapsed, 1e-9))
        self.taus.append(self.committed_calls[0] / max(self.committed_calls[1], 1))
        self.queries += 1
        self._settle_values()
        self._decide()
        self._failsafe()
        stats = dict(self.turn_stats, query=self.queries, signal=round(self.log.signal, 4),
                     values=dict(self.values), events=self.events,
                     buffers={a: len(b) for a, b in self.buffers.items()})
        return {**super().end(state), "adapt": stats}

    # ---- decisions ----------------------------------------------------------------------------
    def _decide(self) -> None:
        o = self.options
        if self.queries <= o.warmup_queries:
            return
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            return
        if self.bandit:
            cold = self.events < o.cold_start_events
            frac = self.events / max(o.cold_start_events - 1, 1)
            eps = o.epsilon[0] + (o.epsilon[-1] - o.epsilon[0]) * min(frac, 1.0)
            action = choose_action(self.values, self.log.signal, cold, eps, self.rng)
        else:
            action = "full"
        self.turn_stats["action"] = action
        if action == "skip" or not self.log.points:
            return
        self.buffers[action].append(self.log)
        if len(self.buffers[action]) >= o.buffer_queries:
            self.scheduled = action

    def _settle_values(self) -> None:
        """Give each finished post-update window's realised gain per unit signal to its action."""
        o = self.options
        for event in list(self.pending_values):
            if len(self.throughput) - event["at"] >= o.value_window:
                after = self.throughput[event["at"]: event["at"] + o.value_window]
                gain = sum(after) / len(after) - event["before"]
                if event["signal"] >= o.s_min:
                    a = event["action"]
                    self.values[a] = o.ewma * self.values[a] + (1 - o.ewma) * gain / event["signal"]
                self.pending_values.remove(event)

    def _failsafe(self) -> None:
        o = self.options
        if self.queries % o.value_window:
            return
        window = self.taus[-o.value_window:]
        self.interval_taus.append(sum(window) / len(window))
        t = self.interval_taus
        if len(t) >= 2 and t[-1] >= t[-2]:
            self.snapshot = self._state()
        falling = len(t) > o.rollback_intervals and all(t[-i] < t[-i - 1] for i in range(1, o.rollback_intervals + 1))
        if falling:
            self.restore(self.snapshot)
            self.turn_stats["rollback"] = True

    # ---- updates ------------------------------------------------------------------------------
    def _update(self, action: str) -> None:
        logs = self.buffers[action]
        self.buffers[action] = []
        signal = sum(log.signal for log in logs) / len(logs)
        loss = self.update_step(action, logs)
        self._sync()
        self.events += 1
        self.cooldown_left = self.options.cooldown
        window = self.throughput[-self.options.value_window:]
        self.pending_values.append({"action": action, "at": len(self.throughput), "signal": signal,
                                    "before": sum(window) / max(len(window), 1)})
        self.turn_stats["update"] = action
        self.turn_stats["update_loss"] = round(loss, 4)

    def update_step(self, action: str, logs: list[QueryLog]) -> float:
        """One optimizer step on the training copy. ``head`` touches only lm_head and the rank head."""
        m = self.train_model
        trainable = set(head_parameters(m)) if action == "head" else {n for n, _ in m.named_parameters()}
        for name, p in m.named_parameters():
            p.requires_grad_(name in trainable)
        self.optimizer.zero_grad(set_to_none=True)
        points = [p for log in logs for p in log.points]
        targets = torch.stack([p.target for p in points]).to(m.lm_head.weight.device)
        buckets = torch.tensor([p.bucket for p in points], device=targets.device)
        if action == "head":
            normed = torch.stack([p.normed for p in points]).to(targets.device)
        else:
            normed = torch.cat([self._rerun(log) for log in logs if log.points])
        logits = m.lm_head(normed)
        loss = -(targets * logits.float().log_softmax(-1)).sum(-1).mean()
        rank_in = torch.cat([normed.detach(), rank_features(logits)], -1)
        loss = loss + F.cross_entropy(m.rank_head(rank_in).float(), buckets)
        if self.bandit and self.options.kl_weight:
            with torch.no_grad():
                ref = self.reference.lm_head(normed.detach() if action == "head" else self._rerun_reference(logs))
            loss = loss + self.options.kl_weight * kl_to_reference(logits, ref)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], self.options.grad_clip)
        self.optimizer.step()
        for p in m.parameters():
            p.requires_grad_(True)
        return float(loss.detach())

    def _rerun(self, log: QueryLog, model: SpecBlockModel | None = None) -> torch.Tensor:
        """RMSNorm(h^L) at the log's rejection points, recomputed through the whole block-1 pass of the query."""
        m = model or self.train_model
        k = m.K
        device = m.lm_head.weight.device
        feats = torch.cat(log.features).to(device)
        n = feats.shape[0]
        tokens = torch.tensor([log.tokens[1: n + 1]], device=device)
        out, _ = block1_pass(m, feats[None], tokens, self.bonus_row)  # the convention the query ran
        rows = torch.tensor([p.position * k + p.slot for p in log.points], device=device)
        return m.norm(out.hidden[0, rows])

    def _rerun_reference(self, logs: list[QueryLog]) -> torch.Tensor:
        return torch.cat([self._rerun(log, self.reference) for log in logs if log.points])

    def _sync(self) -> None:
        """theta_inf <- theta_train (cast to the serving dtype)."""
        with torch.no_grad():
            for (name, p_inf), (_, p_train) in zip(self.model.named_parameters(), self.train_model.named_parameters()):
                p_inf.copy_(p_train.to(p_inf.dtype))

    def _state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.train_model.state_dict().items()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Fail-safe: back to the snapshot, values reset."""
        self.train_model.load_state_dict(snapshot)
        self._sync()
        self.values = {"head": 0.0, "full": 0.0}


@dataclass
class OSDOptions(AdaptOptions):
    lr: float = 1e-4  # the original OSD's constant rate
    warmup_queries: int = 0
    cooldown: int = 0
    kl_weight: float = 0.0


class SpecBlockOSDDrafter(SpecBlockAdaptDrafter):
    """Always update: every 8 queries one full-drafter forward-KL step on the logged points."""

    name = "specblock-osd"
    label = "SpecBlock+OSD"
    family = "specblock"
    Options = OSDOptions
    bandit = False

    def _failsafe(self) -> None:
        pass  # OSD has no fail-safe
