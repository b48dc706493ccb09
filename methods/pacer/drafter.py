"""PACER: SpS whose chain length is set by a trained blockwise pre-verification layer.

The SpS draft model M_D drafts in blocks of ``block`` tokens. After each block a one-layer
transformer M_B of M_D's width — with its own KV cache over the whole context — reads, for every
token, M_D's last hidden state that produced it, plus a learned draft-position embedding e_i for
draft tokens (i = 1, 2, … within the step; committed tokens get none), and predicts each draft's
acceptance α̂ = σ(w·h). Drafting stops when the block's mean α̂ ≤ t; t starts at t_0 every step and
is multiplied by ρ after each block that passes (paper Alg. 1; docs/methods.md#pacer). The failing block is
still verified, so γ = blocks · b (≤ max_gamma). Verification is SpS's chain rule: lossless, because
the stop decision reads only draft-side quantities.

Training (paper §3.3, App. D): replay greedy speculative decoding of M_D against target-regenerated
responses, draft a long window from every step's prefix, label drafts 1 up to the first mismatch and
0 after, pack all steps of one response into one sequence whose mask lets draft m of step i see the
prefix before step i and drafts 1..m of its own step (Fig. 5), binary cross-entropy. The packing and
the loss are here (they share the row convention with inference); `specbench train pacer` is
``trainer.py``.

In a batch (``--batch-size``) every request's chain is drafted together: one draft-model forward per
chain position and one M_B forward per block for the whole batch, each over a ragged cache (a row per
request at its own length, ``engine/batch_cache.py``); every request stops on its own threshold, and a
request that has stopped rides along in the forwards that remain (its rows are dropped, never cached).
A request's draft model and M_B read its prompt when it joins (timed with its prefill).

Row convention shared by training and inference: the M_B row of the token at position p is M_D's
final hidden state at position p − 1 (the state whose logits produced that token), at RoPE position
p. Position 0 (no producing state) has no row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from methods.checkpoints import shipped_drafter
from methods.sps.drafter import SpSDrafter
from methods.weights_options import draft_model_weights
from specbench.engine import kvcache
from specbench.engine.batch_cache import RaggedCache
from specbench.engine.batch_target import forward_rows, pack_rows
from specbench.engine.drafter import DecodeState
from specbench.engine.tree import DraftTree, SiblingKind
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target, resolve_dtype
from specbench.training.checkpoint import check_target, load_drafter, save_drafter, target_fingerprint

METHOD = "pacer"


# ---- the pre-verification layer ---------------------------------------------------------------
class PreVerifier(torch.nn.Module):
    """One decoder layer of the draft model's architecture and width, a final norm, a learned
    draft-position embedding (row 0 = committed token, fixed at zero) and a scalar acceptance head."""

    def __init__(self, draft_config, window: int, use_pos: bool = True) -> None:
        super().__init__()
        from transformers import AutoModel

        cfg = copy.deepcopy(draft_config)
        cfg.num_hidden_layers = 1
        cfg.vocab_size = 1  # inputs are hidden states; the token embedding is never read
        cfg.pad_token_id = None
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[-1:]
        self.body = AutoModel.from_config(cfg)
        self.window, self.use_pos = window, use_pos
        self.pos = torch.nn.Embedding(window + 1, cfg.hidden_size, padding_idx=0) if use_pos else None
        if self.pos is not None:
            torch.nn.init.normal_(self.pos.weight, std=0.02)
            with torch.no_grad():
                self.pos.weight[0].zero_()
        self.head = torch.nn.Linear(cfg.hidden_size, 1)
        self.hidden_size = cfg.hidden_size

    def scale_positions_to(self, states: torch.Tensor) -> float:
        """Redraw e_1.. at the scale of the draft states they are added to (their RMS per coordinate): at
        std 0.02 beside a 0.5B draft's states (RMS 6.5) the draft position is invisible after the input norm and
        the layer scores worse than position alone. Returns the std used."""
        std = float(states.float().pow(2).mean().sqrt())
        if self.pos is not None:
            with torch.no_grad():
                self.pos.weight.normal_(0.0, std)
                self.pos.weight[0].zero_()
        return std

    def init_from_draft(self, draft_model) -> None:
        """Start from the draft model's last decoder layer and final norm (a pretrained layer of the
        right width learns faster on 200 examples than a random one)."""
        self.body.layers[0].load_state_dict(draft_model.model.layers[-1].state_dict())
        self.body.norm.load_state_dict(draft_model.model.norm.state_dict())

    def forward(self, hidden: torch.Tensor, draft_pos: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Acceptance logits [B, T] for rows ``hidden`` [B, T, H] (draft_pos 0 = committed)."""
        x = hidden.to(self.head.weight.dtype)
        if self.pos is not None:
            x = x + self.pos(draft_pos.clamp(max=self.window))
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                        use_cache=cache is not None, **kvcache.cache_arg(self.body, cache))
        return self.head(out.last_hidden_state).squeeze(-1)

    def trainable_parameters(self) -> int:
        """Parameters that are used (the 1-row token embedding never is)."""
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("body.embed_tokens"))


def draft_fingerprint(draft_model) -> str:
    """Which draft model's hidden states a pre-verification layer reads: a hash of its parameters' names,
    shapes and bf16 values at both ends of each tensor (the same whether the draft is loaded in fp32 or
    bf16, and different for any retrained draft)."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in sorted(draft_model.state_dict().items()):
        flat = p.detach().flatten()
        ends = torch.cat([flat[:512], flat[-512:]]).to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(f"{name}{tuple(p.shape)}".encode())
        digest.update(ends.numpy().tobytes())
    return digest.hexdigest()[:16]


def save_preverifier(folder, model: PreVerifier, target: Target, draft: str, recipe: dict, draft_model,
                     dtype: torch.dtype = torch.float32) -> None:
    config = {"method": METHOD, "target": target_fingerprint(target), "recipe": recipe,
              "architecture": {"window": model.window, "use_pos": model.use_pos, "hidden_size": model.hidden_size,
                               "parameters": model.trainable_parameters()},
              "draft": draft or "shipped SpS draft for the target", "draft_fingerprint": draft_fingerprint(draft_model),
              "note": "PACER blockwise pre-verification layer over the SpS draft model's last hidden states"}
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("body.embed_tokens")}
    save_drafter(folder, state, config, dtype=dtype)


def load_preverifier(folder, target: Target, draft_model, dtype: torch.dtype) -> PreVerifier:
    config, state = load_drafter(folder, target)
    if config.get("method") != METHOD:
        raise SpecbenchError(f"{folder} holds a {config.get('method')!r} drafter, not a PACER pre-verification layer")
    check_target(config, target, folder)
    arch = config["architecture"]
    if arch["hidden_size"] != draft_model.config.hidden_size:
        raise SpecbenchError(f"pre-verification layer {folder} reads hidden size {arch['hidden_size']} but the draft "
                             f"model has {draft_model.config.hidden_size}; train one for this draft with "
                             "`specbench train pacer --draft ...`")
    trained_over = config.get("draft_fingerprint")  # absent in layers saved before it was recorded
    if trained_over and trained_over != draft_fingerprint(draft_model):
        raise SpecbenchError(f"pre-verification layer {folder} was trained over another draft model "
                             f"({config['draft']}; it reads that draft's hidden states); pass that draft with "
                             "--opt draft=... or retrain the layer for this one with `specbench train pacer --draft ...`")
    model = PreVerifier(draft_model.config, arch["window"], arch["use_pos"])
    missing = {k for k in model.state_dict() if not k.startswith("body.embed_tokens")} - set(state)
    if missing:
        raise SpecbenchError(f"pre-verification checkpoint {folder} lacks {sorted(missing)[:3]}; it is incomplete")
    model.load_state_dict(state, strict=False)
    return model.to(dtype=dtype, device=next(draft_model.parameters()).device).eval()


# ---- training data: replayed speculative decoding, packed per response -------------------------
def replay_steps(greedy_next: list[int], tokens: list[int], start: int) -> list[tuple[int, int]]:
    """Greedy SD against the fixed sequence ``tokens``: ``greedy_next[j]`` is the draft's argmax after
    tokens[:j+1]. While drafts match they equal the teacher-forced argmaxes, so each step's accepted
    length follows from one forward. Returns (first draft position c, accepted a) per step; the
    target's bonus token is tokens[c + a]."""
    steps, c, n = [], start, len(tokens)
    while c < n:
        a = 0
        while c + a < n and greedy_next[c + a - 1] == tokens[c + a]:
            a += 1
        steps.append((c, a))
        c += a + 1
    return steps


def step_labels(accepted: int, drafted: int) -> list[int]:
    """1 for drafts 1..a (all equal the target so far), 0 from the first mismatch on."""
    return [1] * min(accepted, drafted) + [0] * max(drafted - accepted, 0)


def packed_visibility(prefix_rows: int, steps: list[tuple[int, int]]) -> torch.Tensor:
    """Bool [T, T] mask of one packed response (Fig. 5). Rows 0..prefix_rows-1 are the committed
    tokens at positions 1..prefix_rows (causal). Then each step (c, m) adds m draft rows; draft j of
    that step sees the prefix rows of positions 1..c-1 and drafts 1..j of its own step."""
    total = prefix_rows + sum(m for _, m in steps)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:prefix_rows, :prefix_rows] = torch.ones(prefix_rows, prefix_rows, dtype=torch.bool).tril()
    row = prefix_rows
    for c, m in steps:
        mask[row: row + m, : c - 1] = True
        mask[row: row + m, row: row + m] = torch.ones(m, m, dtype=torch.bool).tril()
        row += m
    return mask


@torch.no_grad()
def _free_drafts(model, cache, n_cached: int, roots: list[tuple[int, int]], length: int, vocab: int) -> torch.Tensor:
    """Greedy drafting from K branch roots at once over one shared teacher-forced cache. Root k is
    (position p, token y): token y at p after the cached tokens [0, p). Feeds ``length`` tokens per
    branch and returns the states after each feed, [K, length, H]."""
    k = len(roots)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    positions = torch.tensor([p for p, _ in roots], device=device)
    tokens = torch.tensor([y for _, y in roots], device=device)
    prefix = torch.arange(n_cached, device=device).unsqueeze(0) < positions.unsqueeze(1)  # [K, n_cached]
    own = torch.eye(k, dtype=torch.bool, device=device)
    states = []
    for d in range(length):
        visible = torch.cat([prefix] + [own] * (d + 1), dim=1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
        out = model(input_ids=tokens.unsqueeze(0), position_ids=(positions + d).unsqueeze(0),
                    attention_mask=mask[None, None], use_cache=True, output_hidden_states=True,
                    **kvcache.cache_arg(model, cache))
        states.append(out.hidden_states[-1][0])
        tokens = out.logits[0, :, :vocab].argmax(-1)
    return torch.stack(states, 1)


@torch.no_grad()
def pack_example(draft_model, example: dict, window: int, vocab: int,
                 store_dtype: torch.dtype = torch.bfloat16) -> dict | None:
    """One packed training sequence for a regenerated response (None if it has no draft step).

    Keys: hidden [T, H] (``store_dtype``: bf16 halves the in-memory dataset), draft_pos [T], position_ids [T], labels [T] (-1 = no loss),
    steps [(c, m)], prefix_rows, accepted (per step)."""
    from transformers import DynamicCache

    tokens = example["prompt_ids"] + example["response_ids"]
    start = len(example["prompt_ids"]) + 1  # the prefill's bonus token comes from the target itself
    if start >= len(tokens):
        return None
    device = next(draft_model.parameters()).device
    cache = DynamicCache()
    out = draft_model(input_ids=torch.tensor([tokens], device=device), use_cache=True,
                      output_hidden_states=True, **kvcache.cache_arg(draft_model, cache))
    forced = out.hidden_states[-1][0]  # [N, H]: state at j produced the draft for position j + 1
    greedy = out.logits[0, :, :vocab].argmax(-1).tolist()
    steps = replay_steps(greedy, tokens, start)
    drafted = [min(window, len(tokens) - c) for c, _ in steps]
    # Drafts after the first mismatch leave the teacher-forced path: draft them for real.
    branches = [(i, c + a, greedy[c + a - 1]) for i, ((c, a), m) in enumerate(zip(steps, drafted)) if m > a + 1]
    free = {}
    if branches:
        length = max(drafted[i] - steps[i][1] - 1 for i, _, _ in branches)
        states = _free_drafts(draft_model, cache, len(tokens), [(p, y) for _, p, y in branches], length, vocab)
        free = {i: states[j] for j, (i, _, _) in enumerate(branches)}
    prefix_rows = len(tokens) - 1
    hidden, draft_pos, pos, labels = [forced[:-1]], [0] * prefix_rows, list(range(1, len(tokens))), [-1] * prefix_rows
    for i, ((c, a), m) in enumerate(zip(steps, drafted)):
        on_path = min(m, a + 1)  # drafts 1..a+1 were produced by teacher-forced states
        rows = [forced[c - 1: c - 1 + on_path]]
        if m > on_path:
            rows.append(free[i][: m - on_path])
        hidden.append(torch.cat(rows))
        draft_pos += list(range(1, m + 1))
        pos += list(range(c, c + m))
        labels += step_labels(a, m)
    return {"hidden": torch.cat(hidden).to(store_dtype).cpu(), "draft_pos": torch.tensor(draft_pos),
            "position_ids": torch.tensor(pos), "labels": torch.tensor(labels, dtype=torch.float32),
            "steps": [(c, m) for (c, _), m in zip(steps, drafted)], "prefix_rows": prefix_rows,
            "accepted": [a for _, a in steps], "id": example.get("id", "")}


@dataclass
class PacerBatch:
    hidden: torch.Tensor  # [B, T, H]
    draft_pos: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, 1, T, T] bool, True = visible
    labels: torch.Tensor  # [B, T], -1 = no loss (committed rows, padding)


def collate(packed: list[dict]) -> PacerBatch:
    """Right-pad packed sequences; padding rows see only themselves (no NaN rows) and carry no loss."""
    width = max(p["hidden"].shape[0] for p in packed)
    b, h = len(packed), packed[0]["hidden"].shape[1]
    hidden = torch.zeros(b, width, h)
    draft_pos = torch.zeros(b, width, dtype=torch.long)
    pos = torch.zeros(b, width, dtype=torch.long)
    labels = torch.full((b, width), -1.0)
    mask = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)
    for i, p in enumerate(packed):
        t = p["hidden"].shape[0]
        hidden[i, :t] = p["hidden"].float()
        draft_pos[i, :t], pos[i, :t], labels[i, :t] = p["draft_pos"], p["position_ids"], p["labels"]
        mask[i, :t, :t] = packed_visibility(p["prefix_rows"], p["steps"])
    return PacerBatch(hidden, draft_pos, pos, mask.unsqueeze(1), labels)


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    greater = (pos.unsqueeze(1) > neg.unsqueeze(0)).float().mean()
    ties = (pos.unsqueeze(1) == neg.unsqueeze(0)).float().mean()
    return float(greater + 0.5 * ties)


def acceptance_logits(model: PreVerifier, batch: PacerBatch) -> torch.Tensor:
    """The layer's acceptance logit at every row of a packed batch [B, T] (Fig. 5 visibility)."""
    mask = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device).masked_fill_(
        ~batch.mask, torch.finfo(torch.float32).min)
    return model(batch.hidden, batch.draft_pos, batch.position_ids, attention_mask=mask)


def pacer_loss(model: PreVerifier, batch: PacerBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Binary cross-entropy of the acceptance logits on draft rows."""
    logits = acceptance_logits(model, batch)
    keep = batch.labels >= 0
    z, y = logits[keep].float(), batch.labels[keep]
    loss = F.binary_cross_entropy_with_logits(z, y)
    with torch.no_grad():
        first = keep & (batch.draft_pos == 1)
        metrics = {"bce": float(loss), "accuracy": float(((z > 0).float() == y).float().mean()),
                   "positive_rate": float(y.mean()), "mean_prob": float(torch.sigmoid(z).mean()),
                   "auc": binary_auc(z, y), "auc_draft1": binary_auc(logits[first].float(), batch.labels[first])}
    return loss, metrics


# ---- inference -----------------------------------------------------------------------------------
def keep_drafting(alphas: list[float], threshold: float) -> bool:
    """The paper's halting rule: continue only while the block's mean predicted acceptance > t."""
    return sum(alphas) / len(alphas) > threshold


@dataclass
class PacerOptions(draft_model_weights("The SpS draft model (empty = the shipped one for the target).")):
    pacer: str = option("", "Pre-verification layer folder or hub id org/name[@rev] (empty = drafters/<target>/pacer).")
    block: int = option(4, "b: drafts per pre-verification.", ge=1, tokens=True)
    threshold: float = option(0.7, "t_0: stop when a block's mean predicted acceptance <= t.", ge=0, le=1)
    rho: float = option(1.05, "Growth of t per passed block (1.0 = no growth).", ge=1)
    max_gamma: int = option(48, "Length cap per step.", ge=1, tokens=True)
    dtype: str = option("", "Draft and pre-verifier dtype; empty = the target's.")


class PacerDrafter(SpSDrafter):
    name = "pacer"
    label = "PACER"
    family = "pacer"
    Options = PacerOptions
    shipped = "pacer"  # folder under drafters/<target>/
    weight_options = ("draft", "pacer")
    trainer = "methods.pacer.trainer:PacerTrainer"  # `specbench train pacer` (no-pos: --no-position-embedding)

    def __init__(self, options: PacerOptions | None = None, model=None, tokenizer=None, preverifier=None) -> None:
        super().__init__(options, model, tokenizer)
        self.mb = preverifier

    def setup(self, target: Target) -> None:
        super().setup(target)
        if self.mb is None:
            shipped = shipped_drafter(target.name, self.shipped)
            folder = self.resolve_weights("pacer", shipped, f"{self.name}: no pre-verification layer at {{path}}; train "
                                          "one with `specbench train pacer --out DIR` and pass --opt pacer=DIR/drafter")
            if not (folder / "config.json").is_file():
                raise SpecbenchError(f"{self.name}: no pre-verification layer at {folder}; train one with "
                                     f"`specbench train pacer --out DIR` and pass --opt pacer=DIR/drafter")
            dtype = resolve_dtype(self.options.dtype or target.dtype)
            self.mb = load_preverifier(folder, target, self.model, dtype)
        self.mb.eval()

    def begin(self, state: DecodeState, prefill) -> None:
        from transformers import DynamicCache

        super().begin(state, prefill)
        self.hidden = torch.empty(0, self.mb.hidden_size, device=self.device)  # M_D final state per fed position
        self.mb_cache = DynamicCache()
        self.mb_rows = 0  # committed tokens (positions 1..mb_rows) whose rows are in mb_cache
        self.lengths: list[int] = []
        self.step_alphas: list[list[float]] = []  # predicted acceptance of every draft, per step
        self.cap_hits = 0

    def _run(self, ids: list[int], start: int, state: DecodeState) -> torch.Tensor:
        with state.timer.forward("drafter"):
            logits, states = self.lm.forward(ids, start, hidden=True, timer=state.timer)
        self.hidden = torch.cat([self.hidden[:start], states[-1].to(self.hidden.dtype)])
        return logits

    def propose(self, state: DecodeState):
        self.n = len(state.tokens)  # first draft sits at position n
        self.t = self.options.threshold  # reset every step (the paper's pseudo-code never does)
        self.step_alphas.append([])
        kvcache.truncate(self.mb_cache, self.mb_rows)
        tree = super().propose(state)
        self.lengths.append(len(tree))
        return tree

    def _stop(self, drafts: list[int], logits: torch.Tensor, state: DecodeState) -> bool:
        if len(drafts) >= self.options.max_gamma:
            self.cap_hits += 1
            return True
        if len(drafts) % self.options.block:
            return False
        alphas = self._preverify(len(drafts) - self.options.block + 1, len(drafts), state)
        self.step_alphas[-1].extend(alphas)
        if not keep_drafting(alphas, self.t):
            return True
        self.t *= self.options.rho
        return False

    def _preverify(self, first: int, last: int, state: DecodeState) -> list[float]:
        """One M_B forward over the committed rows it has not seen and drafts first..last."""
        n, done = self.n, self.mb_rows
        # committed token p (done < p < n) reads state p - 1; draft i reads state n + i - 2
        rows = torch.cat([self.hidden[done: n - 1], self.hidden[n + first - 2: n + last - 1]]).unsqueeze(0)
        draft_pos = torch.tensor([[0] * (n - 1 - done) + list(range(first, last + 1))], device=self.device)
        pos = torch.cat([torch.arange(done + 1, n), torch.arange(n + first - 1, n + last)]).to(self.device).unsqueeze(0)
        with torch.inference_mode(), state.timer.forward("preverify"):
            alpha = torch.sigmoid(self.mb(rows, draft_pos, pos, cache=self.mb_cache).float())[0, -(last - first + 1):]
        self.mb_rows = n - 1
        return alpha.tolist()

    def end(self, state: DecodeState) -> dict:
        return self._stats(self.lengths, self.step_alphas, self.cap_hits)

    def _stats(self, lengths: list[int], step_alphas: list[list[float]], cap_hits: int) -> dict:
        steps = max(len(lengths), 1)
        scored = [a for step in step_alphas for a in step]
        return {"mean_gamma": sum(lengths) / steps, "gamma_hist": _histogram(lengths),
                "preverify_calls": sum(len(a) for a in step_alphas) // self.options.block,
                # 4 decimals: a batch chunks M_B's forwards differently, which moves the mean in its 8th
                "mean_alpha": round(sum(scored) / max(len(scored), 1), 4),
                "cap_hits": cap_hits, "block": self.options.block, "threshold": self.options.threshold,
                "rho": self.options.rho}

    # ---- batches: every request's chain in one draft forward per position, one M_B forward per block ----
    @property
    def batched_drafting(self) -> bool:
        return True

    def begin_batch(self, states, prefills) -> None:
        from transformers import DynamicCache

        if not getattr(self, "rows", None):  # a batch that emptied starts fresh caches
            self.rows, self.mb_ragged, self.row_state = RaggedCache(), RaggedCache(), []
        for state in states:
            prompt = state.tokens[: state.prompt_len]
            draft_cache, mb_cache = DynamicCache(), DynamicCache()
            with torch.inference_mode():
                with state.timer.forward("drafter"):
                    out = self.model(input_ids=torch.tensor([prompt], device=self.device), use_cache=True,
                                     output_hidden_states=True, **kvcache.cache_arg(self.model, draft_cache))
                hidden = out.hidden_states[-1][0].to(self.mb.head.weight.dtype)
                # M_B rows of the committed prompt tokens 1..P-1 (token p reads state p - 1); one row to
                # build the cache from when there are none (a one-token prompt), cached as zero rows.
                rows = max(len(prompt) - 1, 1)
                with state.timer.forward("preverify"):
                    self.mb(hidden[:rows][None], torch.zeros(1, rows, dtype=torch.long, device=self.device),
                            torch.arange(1, rows + 1, device=self.device)[None], cache=mb_cache)
            self.rows.add(draft_cache, len(prompt))
            self.mb_ragged.add(mb_cache, len(prompt) - 1)
            self.row_state.append(_PacerRow(tokens=list(prompt), hidden=hidden, mb_done=len(prompt) - 1))

    def observe_batch(self, states, results) -> None:
        pass  # the threshold resets every step: nothing to learn from a verify

    def end_batch(self, rows, states) -> list[dict]:
        self.rows.remove(rows)
        self.mb_ragged.remove(rows)
        leaving = [self.row_state[b] for b in rows]
        self.row_state = [r for b, r in enumerate(self.row_state) if b not in set(rows)]
        return [self._stats(r.lengths, r.step_alphas, r.cap_hits) for r in leaving]

    def propose_batch(self, states) -> list[DraftTree]:
        o, timer = self.options, states[0].timer
        feeds = []
        for b, (state, row) in enumerate(zip(states, self.row_state)):  # keep the longest cached prefix still committed
            keep, limit = 0, min(len(row.tokens), len(state.tokens) - 1)
            while keep < limit and row.tokens[keep] == state.tokens[keep]:
                keep += 1
            self.rows.truncate(b, keep)
            self.mb_ragged.truncate(b, row.mb_done)
            row.hidden = row.hidden[:keep]
            feeds.append(state.tokens[keep:])
            row.step_alphas.append([])
        n = [len(state.tokens) for state in states]  # each request's first draft sits at position n
        thresholds = [o.threshold] * len(states)  # reset every step (the paper's pseudo-code never does)
        drafting = [True] * len(states)
        drafts: list[list[int]] = [[] for _ in states]
        qs: list[list[torch.Tensor]] = [[] for _ in states]
        greedy = [state.params.greedy for state in states]
        while any(drafting):
            logits = self._ragged_draft(feeds, drafting, timer)
            picks = logits.argmax(-1).tolist() if any(greedy) else None
            for b, state in enumerate(states):
                if drafting[b]:
                    token, q = (picks[b], None) if greedy[b] else self._pick(logits[b], state)
                    drafts[b].append(token)
                    qs[b].append(q)
            depth = len(drafts[drafting.index(True)])  # every request still drafting has this many drafts
            if depth % o.block == 0 and depth < o.max_gamma:
                alphas = self._ragged_preverify(n, depth - o.block + 1, depth, drafting, timer)
            for b, row in enumerate(self.row_state):
                if not drafting[b]:
                    continue
                if depth >= o.max_gamma:
                    row.cap_hits += 1
                    drafting[b] = False
                elif depth % o.block == 0:
                    row.step_alphas[-1].extend(alphas[b])
                    if keep_drafting(alphas[b], thresholds[b]):
                        thresholds[b] *= o.rho
                    else:
                        drafting[b] = False
            feeds = [[chain[-1]] for chain in drafts]
        for state, row, chain in zip(states, self.row_state, drafts):
            row.tokens = state.tokens + chain[:-1]
            row.lengths.append(len(chain))
        return [DraftTree.chain(chain) if exact else
                DraftTree.chain(chain, q=torch.stack(q), kind=SiblingKind.SAMPLED_IID)
                for chain, q, exact in zip(drafts, qs, greedy)]

    def _ragged_draft(self, feeds: list[list[int]], drafting: list[bool], timer) -> torch.Tensor:
        """One draft forward over the feeds of the requests still drafting (the others ride along uncached);
        keeps every fed position's final state; [B, V] logits at each last token."""
        dtype = next(self.model.parameters()).dtype
        starts = list(self.rows.lengths)
        packed = pack_rows([(feed, range(-1, len(feed) - 2)) for feed in feeds], self.rows, self.device, dtype)
        out = forward_rows(self.model, self.rows, packed, taps=(-1,), timer=timer, owner="drafter")
        self.rows.commit(packed.width, [range(len(feed)) if live else [] for feed, live in zip(feeds, drafting)])
        states = out.hidden_states[-1]
        for b, (row, feed, start) in enumerate(zip(self.row_state, feeds, starts)):
            if drafting[b]:
                row.hidden = torch.cat([row.hidden[:start], states[b, : len(feed)].to(row.hidden.dtype)])
        last = torch.tensor([len(feed) - 1 for feed in feeds], device=out.logits.device)
        return out.logits[torch.arange(len(feeds), device=last.device), last, : self.vocab]

    def _ragged_preverify(self, n: list[int], first: int, last: int, drafting: list[bool], timer) -> list[list[float]]:
        """``_preverify`` of every request still drafting in ONE M_B forward (the others ride along uncached);
        the predicted acceptance of drafts first..last per request ([] for the others)."""
        blocks = []
        for row, start, live in zip(self.row_state, n, drafting):
            if not live:  # one row to ride along
                blocks.append((row.hidden.new_zeros(1, row.hidden.shape[-1]), [0], [1]))
                continue
            done = row.mb_done  # committed token p (done < p < n) reads state p - 1; draft i reads n + i - 2
            blocks.append((torch.cat([row.hidden[done: start - 1], row.hidden[start + first - 2: start + last - 1]]),
                           [0] * (start - 1 - done) + list(range(first, last + 1)),
                           list(range(done + 1, start)) + list(range(start + first - 1, start + last))))
        q, width = max(len(b[1]) for b in blocks), self.mb_ragged.width
        dtype = self.mb.head.weight.dtype
        rows = blocks[0][0].new_zeros(len(blocks), q, blocks[0][0].shape[-1])
        draft_pos = torch.zeros(len(blocks), q, dtype=torch.long)
        positions = torch.zeros(len(blocks), q, dtype=torch.long)
        for b, (hidden, pos_in_step, pos) in enumerate(blocks):
            rows[b, : len(pos)] = hidden
            draft_pos[b, : len(pos)] = torch.tensor(pos_in_step)
            positions[b, : len(pos)] = torch.tensor(pos)
        causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()  # padding rows see the real ones
        see = torch.cat([self.mb_ragged.live(self.device)[:, None, :].expand(-1, q, -1),
                         causal.expand(len(blocks), q, q)], 2)
        mask = torch.zeros(see.shape, dtype=dtype, device=self.device).masked_fill_(~see, torch.finfo(dtype).min)
        with torch.inference_mode(), timer.forward("preverify"):
            logits = self.mb(rows, draft_pos.to(self.device), positions.to(self.device), attention_mask=mask[:, None],
                             cache=self.mb_ragged.cache)
        self.mb_ragged.commit(width, [range(len(b[1])) if live else [] for b, live in zip(blocks, drafting)])
        alphas = torch.sigmoid(logits.float()).tolist()
        out = []
        for b, (row, (_, pos_in_step, _), start) in enumerate(zip(self.row_state, blocks, n)):
            if drafting[b]:
                row.mb_done = start - 1
            out.append(alphas[b][len(pos_in_step) - (last - first + 1): len(pos_in_step)] if drafting[b] else [])
        return out


@dataclass(eq=False)
class _PacerRow:
    """One request of a batch: the tokens its draft cache holds, M_D's final state at each of them, the
    committed M_B rows, and its record's statistics."""

    tokens: list[int]
    hidden: torch.Tensor  # [positions fed, H]
    mb_done: int  # committed tokens (positions 1..mb_done) whose M_B rows are cached
    lengths: list[int] = field(default_factory=list)
    step_alphas: list[list[float]] = field(default_factory=list)
    cap_hits: int = 0


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in sorted(values):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


class PacerNoPosDrafter(PacerDrafter):
    """Ablation (paper Table 5): a layer trained and run without the draft-position embedding."""

    name = "pacer-no-pos"
    label = "PACER w/o pos-emb"
    ablation_of = "pacer"
    shipped = "pacer-no-pos"


@dataclass
class PacerNoGrowthOptions(PacerOptions):
    rho: float = 1.0


class PacerNoGrowthDrafter(PacerDrafter):
    """Ablation (paper Table 5): constant threshold (ρ = 1)."""

    name = "pacer-no-growth"
    label = "PACER w/o growth-factor"
    ablation_of = "pacer"
    Options = PacerNoGrowthOptions
