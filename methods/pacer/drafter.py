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
prefix before step i and drafts 1..m of its own step (Fig. 5), binary cross-entropy: the layer is
``model.py``, on disk ``checkpoint.py``, the packing ``packing.py`` (it shares the row convention below with
inference), the loss and AUC ``objective.py``, and `specbench train pacer` ``trainer.py``.

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

from dataclasses import dataclass, field

import torch

from methods.checkpoints import shipped_drafter
from methods.pacer.checkpoint import load_preverifier
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
