"""SpecBlock: block-iterative drafting with a rank head (paper Alg. 2; docs/methods.md#specblock-inference).

Each propose call makes M drafter forwards:

1. **Block 1** (one forward that also encodes the newly committed positions): the last committed
   pair (taps n-1, bonus) yields K dependent slots. The greedy chain g_0..g_{K-1} goes under the
   root; slot k attaches the top b(bucket_k) tokens (including the greedy one) as children of
   g_{k-1}. Slot 0 attaches ``beam_width`` tokens, as the authors' released code does; the
   paper's Alg. 2 gives it b(bucket_0) like every other slot, which ``slot0="rank"`` selects. The
   reference set was measured with the default. A give-up bucket (b = 0) stops alternatives there
   and at every later slot.
2. **Next-block starts**: the greedy node and alternatives of every slot whose bucket is not
   "confident", plus the chain end unless the chain's first non-confident bucket is give-up. A
   start carries the pre-norm h^L of the slot that produced its token and may attend to the
   producing block's slots 0..k (Fig. 3). The best min(beam_width, remaining budget / K) by score
   are expanded in **one batched forward**, with the same rules (slot 0 now uses b(bucket)).
3. Nodes merge into a trie (a duplicate sibling is the same node, so a block-2 chain that repeats
   block 1 deepens it instead of being dropped); the best ``budget`` nodes by cumulative draft
   log-probability are kept, ancestor-closed. The tree is deterministic: rule A at T > 0.

The drafter keeps K cache entries per committed position (every slot of its block-1 forward);
cross-block keys are transient. ``bonus_row`` picks how block 1 reads the last committed pair
(model.py): ``once``, its cached group is block 1; ``duplicate`` (the authors' inference
code), a transient copy one position later that sees every cached group, the pair's own included.
A drafter runs the convention its checkpoint records unless told otherwise.

In a batch (``--batch-size``) every forward serves the whole batch: one forward encodes every request's
newly committed pairs and its block 1 (groups right-padded to the longest, over a ragged cache: one row
per request holding its K rows per committed position, ``RaggedKV`` per layer), and each later block is
one forward over every request's chosen starts, each start seeing its own request's cached and
transient rows through the mask. Tries, starts and node selection stay per request.

Variants: ``specblock-no-broadcast``, ``-no-shift``, ``-no-valid-prefix`` load drafters trained
without that component; ``specblock-uniform-tree`` replaces rank-guided branching by a fixed top-k
at every slot under the same node budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from methods.tree_select import select_nodes
from methods.checkpoints import shipped_drafter
from methods.specblock.checkpoint import load_specblock
from methods.specblock.model import NUM_BUCKETS, KV, SpecBlockModel, draft_row_offset, rank_to_bucket
from methods.specblock.objective import block1_mask
from methods.weights_options import drafter_weights
from specbench.engine.batch_cache import RaggedKV
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target, TargetOutput
from specbench.engine.tree import DraftTree, SiblingKind


@dataclass
class SpecBlockOptions(drafter_weights("Drafter folder", "ours or the published layout", "<variant>")):
    budget: int = option(60, "Draft nodes verified per call (paper <= 60; reference 90).", ge=1, tokens=True)
    blocks: int = option(2, "M: drafter forwards per call.", ge=1)
    beam_width: int = option(10, "Block-1 slot-0 width (slot0=beam), and the most starts per later block.", ge=1)
    slot0: Literal["beam", "rank"] = option("beam", "Block-1 slot 0: beam = beam_width tokens (the authors' "
                                                    "code); rank = b(bucket) (paper Alg. 2).")
    branching: list[int] = option([2, 4, 10, 0], f"b(bucket), one width per rank bucket ({NUM_BUCKETS}), greedy "
                                                 "included; the paper's maps are 2,4,10,0 and 2,4,6,4.", ge=0)
    trim: float = option(0.0, "> 0: a slot whose greedy probability >= trim attaches only the greedy token "
                              "(reference knob).", ge=0, le=1)
    uniform_width: int = option(0, "> 0: ignore the rank head; every slot attaches this many tokens (ablation).", ge=0)
    bonus_row: Literal["trained", "once", "duplicate"] = option(
        "trained", "Block 1's reading of the last committed pair: once = its cached row group is block 1 (ours, "
                   "the paper's); duplicate = a copy one position later that also sees that group (the authors' "
                   "inference code); trained = what the drafter's checkpoint records (once if it records none). "
                   "Each record's extra says which ran.")

    def check(self, owner: str) -> None:
        if len(self.branching) != NUM_BUCKETS:
            raise SpecbenchError(f"{owner}: branching needs {NUM_BUCKETS} non-negative widths, one per rank bucket "
                                 f"(got {self.branching}); the paper's maps are 2,4,10,0 and 2,4,6,4")


@dataclass
class _Node:
    parent: int
    token: int  # target id
    score: float


@dataclass
class _Start:
    """A next-block start: a trie node, the h^L of the slot that produced its token, and which
    existing drafter rows (cache, then transient) it may attend to (Fig. 3's on-path rows)."""

    node: int
    hidden: torch.Tensor  # [H]
    visible: torch.Tensor  # [cache rows + transient rows] bool


@dataclass
class _Block:
    """One block's slots, on the CPU where the tree is built."""

    log_probs: torch.Tensor  # [K, width] top draft log-probs, descending
    ids: torch.Tensor  # [K, width] their target ids
    buckets: list[int]  # rank-head argmax per slot


class SpecBlockDrafter(Drafter):
    name = "specblock"
    label = "SpecBlock"
    Options = SpecBlockOptions
    weights_name = "specblock"  # shipped folder under drafters/<target>/
    weight_options = ("path",)
    budget_option = "budget"
    trainer = "methods.specblock.trainer:SpecBlockTrainer"
    # What `specbench train specblock --variant` changes to train this class's weights (SpecBlockConfig
    # fields; ``valid_prefix`` for the loss): the variants' one declaration.
    trained_with: dict = {}

    @classmethod
    def variant(cls) -> str:
        """The `specbench train specblock --variant` whose drafter this class loads."""
        return cls.weights_name.removeprefix("specblock").lstrip("-") or "full"

    def __init__(self, options: SpecBlockOptions | None = None, model: SpecBlockModel | None = None) -> None:
        super().__init__(options)
        self.model = model

    # ---- lifecycle ------------------------------------------------------------------------
    def setup(self, target: Target) -> None:
        super().setup(target)
        if self.model is None:
            shipped = shipped_drafter(target.name, self.weights_name)
            variant = self.variant()
            command = "specbench train specblock" + (f" --variant {variant}" if variant != "full" else "")
            path = self.resolve_weights("path", shipped, f"{self.name} needs a drafter folder for target {target.name!r} "
                                        f"({{path}} does not exist); pass --opt path=FOLDER_OR_HUB_ID or train one "
                                        f"with `{command}`")
            self.model = load_specblock(path, target)
        self.model.to(device=target.device, dtype=target.dtype).eval()
        self.taps = self.model.taps
        o = self.options
        self.trained_bonus_row = self.model.config.bonus_row
        self.bonus_row = self.trained_bonus_row if o.bonus_row == "trained" else o.bonus_row
        self.width = min(max(o.beam_width, *o.branching, o.uniform_width, 1), self.model.config.draft_vocab_size)
        self.draft_index = self.model.draft_index().cpu()
        self.stats = RankStats()

    def begin(self, state: DecodeState, prefill: TargetOutput) -> None:
        self.cache: list[KV] | None = None  # K rows per committed position
        self.encoded = 0  # committed positions in the cache
        self.pending = self.model.features(prefill.taps)
        self.stats = RankStats()

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        # Transient block rows never enter self.cache; the kept rows' taps are the next positions.
        self.pending = self.model.features(result.taps)
        self.stats.observe(self._chain, result, self.draft_index)

    def end(self, state: DecodeState) -> dict:
        # which block-1 convention ran, and which the drafter was trained with
        return {**self.stats.summary(), "bonus_row": self.bonus_row, "bonus_row_trained": self.trained_bonus_row}

    # ---- one propose call ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        k = self.model.K
        out, transient, rows = self._encode(state)
        trie = _Trie()
        block = self._block(out.logits[0, -k:], out.rank_logits[0, -k:])
        # rows: cache then transient; block 1 is the last K of them (the last cached group, or the copy)
        older = torch.ones(rows, dtype=torch.bool)
        older[-k:] = False  # block 1's slots are on-path only up to the start's slot
        self._chain = ChainRecord(out.logits[0, -k:].float().cpu(), block.buckets,
                                  hidden=self.model.norm(out.hidden[0, -k:]).float().cpu(), position=self.encoded - 1)
        slot_starts = self._expand(trie, -1, 0.0, block, first=True, chain=self._chain.nodes)
        starts = [_Start(node, out.hidden[0, slot - k], _with_slots(older, rows - k, slot))
                  for node, slot in slot_starts]
        for _ in range(1, self.options.blocks):
            chosen = self._choose(trie, starts)
            if not chosen:
                break
            out, transient = self._run_starts(state, trie, chosen, transient)
            starts = []
            for g, start in enumerate(chosen):
                rows = slice(g * k, (g + 1) * k)
                blk = self._block(out.logits[0, rows], out.rank_logits[0, rows])
                base = torch.cat([start.visible, torch.zeros(len(chosen) * k, dtype=torch.bool)])
                first_row = start.visible.numel() + g * k
                for node, slot in self._expand(trie, start.node, trie.nodes[start.node].score, blk, first=False):
                    starts.append(_Start(node, out.hidden[0, g * k + slot], _with_slots(base, first_row, slot)))
        with state.timer.phase("tree_build"):
            return self._to_tree(trie)

    def _encode(self, state: DecodeState):
        """Every newly committed pair (taps j, token j+1) as K cached rows, and block 1 in one forward.
        Returns block 1's output (its last K rows), the transient rows' keys/values (none for ``once``,
        where the last pair's group is block 1; the copy's for ``duplicate``) and the number of rows
        (cache, then transient) a start's visibility covers."""
        m, k = self.model, self.model.K
        device = self.target.device
        start = self.encoded
        condition = self.pending[None]
        ids = torch.tensor([state.tokens[start + 1:]], device=device)
        g = ids.shape[1]
        copy = self.bonus_row == "duplicate"
        if copy:  # the last pair once more, as one more group one position later
            condition = torch.cat([condition, condition[:, -1:]], 1)
            ids = torch.cat([ids, ids[:, -1:]], 1)
        groups = g + copy
        positions = torch.arange(start, start + groups, device=device)[:, None] + 1 + torch.arange(k, device=device)
        visible = torch.cat([torch.ones(groups * k, start * k, dtype=torch.bool, device=device),
                             block1_mask(groups, k, device)], 1)
        with state.timer.forward("drafter"):
            # the copy's heads only: the context rows' keys/values are all that is read of them
            heads = {"heads_from": g * k} if copy else {}
            out = m(condition, ids, positions.reshape(1, -1), visible, past=self.cache, **heads)
        kept = [(key[:, :, : g * k], value[:, :, : g * k]) for key, value in out.kv]
        transient = [(key[:, :, g * k:], value[:, :, g * k:]) for key, value in out.kv]
        self.cache = kept if self.cache is None else [
            (torch.cat([c[0], n[0]], 2), torch.cat([c[1], n[1]], 2)) for c, n in zip(self.cache, kept)]
        self.encoded += g
        self.pending = self.pending[:0]
        return out, transient, self.encoded * k + copy * k

    def _run_starts(self, state: DecodeState, trie: "_Trie", chosen: list[_Start], transient: list[KV]):
        """One batched forward over every start (K slots each): each sees its visible rows and itself causally."""
        m, k = self.model, self.model.K
        device = self.target.device
        g = len(chosen)
        offset = draft_row_offset(self.bonus_row)
        positions = (self.encoded + offset + torch.arange(k, device=device)).repeat(g)[None]  # block 1's ids
        seen = torch.stack([s.visible for s in chosen]).repeat_interleave(k, 0)
        group = torch.arange(g * k) // k
        own = block1_mask(g, k) & (group[None] == group[:, None])
        visible = torch.cat([seen, own], 1).to(device)
        condition = torch.stack([s.hidden for s in chosen])[None]
        tokens = torch.tensor([[trie.nodes[s.node].token for s in chosen]], device=device)
        past = [(torch.cat([c[0], t[0]], 2), torch.cat([c[1], t[1]], 2)) for c, t in zip(self.cache, transient)]
        with state.timer.forward("drafter"):
            out = m(condition, tokens, positions, visible, past=past)
        transient = [(torch.cat([t[0], n[0]], 2), torch.cat([t[1], n[1]], 2)) for t, n in zip(transient, out.kv)]
        return out, transient

    # ---- tree construction -----------------------------------------------------------------
    def _block(self, logits: torch.Tensor, rank_logits: torch.Tensor) -> _Block:
        # log_softmax <= 0 keeps scores non-increasing along paths (select_nodes relies on it).
        lp = logits.float().log_softmax(-1).clamp(max=0.0)
        top_lp, top_ids = lp.topk(self.width, dim=-1)
        return _Block(top_lp.cpu(), self.model.to_target_ids(top_ids).cpu(), rank_logits.argmax(-1).tolist())

    def _expand(self, trie: "_Trie", parent: int, score: float, block: _Block, first: bool,
                chain: list[int] | None = None) -> list[tuple[int, int]]:
        """Attach one block's greedy chain and alternatives under ``parent``; return its
        next-block starts as (node, producing slot)."""
        o = self.options
        starts: list[tuple[int, int]] = []
        node, give_up, first_unsure = parent, False, None
        for k, bucket in enumerate(block.buckets):
            lp, ids = block.log_probs[k].tolist(), block.ids[k].tolist()
            if o.uniform_width:
                width = o.uniform_width
            else:
                width = o.beam_width if first and k == 0 and o.slot0 == "beam" else o.branching[bucket]
                give_up = give_up or (width == 0)
                if o.trim and math.exp(lp[0]) >= o.trim:
                    width = 1
            greedy = trie.add(node, ids[0], score + lp[0])
            alternatives = [] if give_up else [trie.add(node, ids[i], score + lp[i]) for i in range(1, min(width, len(ids)))]
            if chain is not None:
                chain.append(greedy)
            if o.uniform_width or (bucket != 0 and not give_up):
                starts += [(n, k) for n in (greedy, *alternatives)]
            if first_unsure is None and bucket != 0:
                first_unsure = bucket
            node, score = greedy, score + lp[0]
        end_ok = o.uniform_width or first_unsure is None or o.branching[first_unsure] > 0
        if end_ok and all(n != node for n, _ in starts):
            starts.append((node, len(block.buckets) - 1))
        return starts

    def _choose(self, trie: "_Trie", starts: list[_Start]) -> list[_Start]:
        """The best min(beam_width, remaining budget / K) starts by score, one per node."""
        limit = min(self.options.beam_width, (self.options.budget - len(trie)) // self.model.K)
        unique: dict[int, _Start] = {}
        for s in starts:
            unique.setdefault(s.node, s)
        return sorted(unique.values(), key=lambda s: -trie.nodes[s.node].score)[:max(limit, 0)]

    # ---- batches: every request's encode and every block in one forward -------------------------
    batched_drafting = True

    def begin_batch(self, states, prefills) -> None:
        if not hasattr(self, "rows"):  # the first batch: a cache per layer (rows come and go with requests)
            cfg = self.model.config
            self.rows = [RaggedKV(cfg.num_key_value_heads, cfg.head_dim, self.target.device, self.model.dtype)
                         for _ in range(cfg.num_layers)]
            self.row_pending, self.row_encoded, self.row_stats, self.row_chain = [], [], [], []
        for layer in self.rows:
            layer.add_empty(len(states))
        self.row_pending += [self.model.features(prefill.taps) for prefill in prefills]
        self.row_encoded += [0] * len(states)
        self.row_stats += [RankStats() for _ in states]
        self.row_chain += [None] * len(states)

    def observe_batch(self, states, results) -> None:
        self.row_pending = [self.model.features(result.taps) for result in results]
        for stats, chain, result in zip(self.row_stats, self.row_chain, results):
            stats.observe(chain, result, self.draft_index)

    def end_batch(self, rows, states) -> list[dict]:
        for layer in self.rows:
            layer.remove(rows)
        gone = set(rows)
        stats = [self.row_stats[b] for b in rows]
        self.row_pending, self.row_encoded, self.row_stats, self.row_chain = (
            [x for b, x in enumerate(values) if b not in gone]
            for values in (self.row_pending, self.row_encoded, self.row_stats, self.row_chain))
        return [{**s.summary(), "bonus_row": self.bonus_row, "bonus_row_trained": self.trained_bonus_row}
                for s in stats]

    @torch.inference_mode()
    def propose_batch(self, states) -> list[DraftTree]:
        k, timer = self.model.K, states[0].timer
        blocks1, transient, rows = self._encode_batch(states, timer)
        tries, starts, chains = [], [], []
        for b, (out, count) in enumerate(zip(blocks1, rows)):  # as ``propose``, request by request
            hidden, logits, rank_logits = out
            trie = _Trie()
            block = self._block(logits, rank_logits)
            older = torch.ones(count, dtype=torch.bool)
            older[-k:] = False
            chain = ChainRecord(logits.float().cpu(), block.buckets, hidden=self.model.norm(hidden).float().cpu(),
                                position=self.row_encoded[b] - 1)
            slot_starts = self._expand(trie, -1, 0.0, block, first=True, chain=chain.nodes)
            starts.append([_Start(node, hidden[slot], _with_slots(older, count - k, slot))
                           for node, slot in slot_starts])
            tries.append(trie)
            chains.append(chain)
        for _ in range(1, self.options.blocks):
            chosen = [self._choose(trie, s) for trie, s in zip(tries, starts)]
            if not any(chosen):
                break
            out, transient = self._run_starts_batch(tries, chosen, transient, timer)
            for b, (trie, picked) in enumerate(zip(tries, chosen)):
                starts[b] = []
                for g, start in enumerate(picked):
                    group = slice(g * k, (g + 1) * k)
                    blk = self._block(out.logits[b, group], out.rank_logits[b, group])
                    base = torch.cat([start.visible, torch.zeros(len(picked) * k, dtype=torch.bool)])
                    first_row = start.visible.numel() + g * k
                    for node, slot in self._expand(trie, start.node, trie.nodes[start.node].score, blk, first=False):
                        starts[b].append(_Start(node, out.hidden[b, g * k + slot], _with_slots(base, first_row, slot)))
        with timer.phase("tree_build"):
            trees = []
            for trie, chain in zip(tries, chains):
                self._chain = chain  # _to_tree maps this request's chain onto its tree
                trees.append(self._to_tree(trie))
        self.row_chain = chains
        return trees

    def _encode_batch(self, states, timer):
        """``_encode`` for every request in ONE forward (new pairs right-padded to the longest; a request's
        copy, for ``duplicate``, right after its own pairs). Returns per request block 1's (hidden, logits,
        rank logits) [K, ..], its transient rows' keys/values per layer ([1, heads, K or 0, d]) and the rows
        (cache, then transient) a start's visibility covers."""
        m, k, device = self.model, self.model.K, self.target.device
        copy = self.bonus_row == "duplicate"
        counts = [p.shape[0] for p in self.row_pending]
        groups = max(counts) + copy
        first = self.row_pending[0]
        condition = first.new_zeros(len(states), groups, first.shape[-1])
        ids = torch.zeros(len(states), groups, dtype=torch.long)
        for b, (state, pending, start, g) in enumerate(zip(states, self.row_pending, self.row_encoded, counts)):
            condition[b, :g] = pending
            ids[b, :g] = torch.tensor(state.tokens[start + 1:])
            if copy:  # the last pair once more, as one more group one position later
                condition[b, g], ids[b, g] = pending[-1], ids[b, g - 1]
        encoded = torch.tensor(self.row_encoded, device=device)
        positions = (encoded[:, None, None] + torch.arange(groups, device=device)[None, :, None] + 1
                     + torch.arange(k, device=device)[None, None, :]).reshape(len(states), -1)
        live = self.rows[0].live()[:, None, :].expand(-1, groups * k, -1)
        visible = torch.cat([live, block1_mask(groups, k, device).expand(len(states), -1, -1)], 2)
        with timer.forward("drafter"):
            out = m(condition, ids.to(device), positions, visible, past=[layer.past for layer in self.rows])
        transient = [[(key[b: b + 1, :, g * k: (g + copy) * k], value[b: b + 1, :, g * k: (g + copy) * k])
                      for key, value in out.kv] for b, g in enumerate(counts)]
        for layer, (key, value) in zip(self.rows, out.kv):
            layer.keep((torch.cat([layer.keys, key], 2), torch.cat([layer.values, value], 2)),
                       [range(g * k) for g in counts])
        self.row_encoded = [e + g for e, g in zip(self.row_encoded, counts)]
        self.row_pending = [p[:0] for p in self.row_pending]
        blocks1 = []
        for b, g in enumerate(counts):  # block 1: the last pair's group (once) or its copy (duplicate)
            rows = slice((g - 1 + copy) * k, (g + copy) * k)
            blocks1.append((out.hidden[b, rows], out.logits[b, rows], out.rank_logits[b, rows]))
        return blocks1, transient, [e * k + copy * k for e in self.row_encoded]

    def _run_starts_batch(self, tries: list["_Trie"], chosen: list[list[_Start]], transient: list[list[KV]], timer):
        """``_run_starts`` for every request in ONE forward: request b's starts (padded to the most any
        request has) see its cached rows at columns [0, its length) and its transient rows after the
        widest cache; a padding start sees only itself."""
        m, k, device = self.model, self.model.K, self.target.device
        b_size, g = len(chosen), max(len(c) for c in chosen)
        width = self.rows[0].width
        spans = [t[0][0].shape[2] for t in transient]
        most = max(spans)
        past = []
        for i, layer in enumerate(self.rows):
            keys = layer.keys.new_zeros(b_size, layer.keys.shape[1], width + most, layer.keys.shape[3])
            values = torch.zeros_like(keys)
            keys[:, :, :width], values[:, :, :width] = layer.keys, layer.values
            for b, rows in enumerate(transient):
                keys[b, :, width: width + spans[b]] = rows[i][0][0]
                values[b, :, width: width + spans[b]] = rows[i][1][0]
            past.append((keys, values))
        seen = torch.zeros(b_size, g * k, width + most, dtype=torch.bool)
        condition = self.rows[0].keys.new_zeros(b_size, g, self.model.config.hidden_size)
        tokens = torch.zeros(b_size, g, dtype=torch.long)
        for b, (trie, picked, length) in enumerate(zip(tries, chosen, self.rows[0].lengths)):
            for j, start in enumerate(picked):
                rows = slice(j * k, (j + 1) * k)
                seen[b, rows, :length] = start.visible[:length]
                seen[b, rows, width: width + spans[b]] = start.visible[length:]
                condition[b, j] = start.hidden
                tokens[b, j] = trie.nodes[start.node].token
        group = torch.arange(g * k) // k
        own = block1_mask(g, k) & (group[None] == group[:, None])
        visible = torch.cat([seen, own.expand(b_size, -1, -1)], 2).to(device)
        offset = draft_row_offset(self.bonus_row)
        encoded = torch.tensor(self.row_encoded, device=device)
        positions = (encoded[:, None] + offset + torch.arange(k, device=device)[None]).repeat(1, g)
        with timer.forward("drafter"):
            out = m(condition, tokens.to(device), positions, visible, past=past)
        transient = [[(torch.cat([t[0], key[b: b + 1, :, : len(picked) * k]], 2),
                       torch.cat([t[1], value[b: b + 1, :, : len(picked) * k]], 2))
                      for t, (key, value) in zip(rows, out.kv)]
                     for b, (rows, picked) in enumerate(zip(transient, chosen))]
        return out, transient

    def _to_tree(self, trie: "_Trie") -> DraftTree:
        parents = torch.tensor([n.parent for n in trie.nodes], dtype=torch.long)
        scores = torch.tensor([n.score for n in trie.nodes], dtype=torch.float32)
        tokens = torch.tensor([n.token for n in trie.nodes], dtype=torch.long)
        keep = select_nodes(parents, scores, self.options.budget).tolist()
        new_index = {-1: -1} | {old: new for new, old in enumerate(keep)}
        self._chain.tree_index = new_index
        new_parents = torch.tensor([new_index[int(parents[i])] for i in keep], dtype=torch.long)
        return DraftTree(tokens[keep], new_parents, scores=scores[keep], kind=SiblingKind.DETERMINISTIC)


def _with_slots(base: torch.Tensor, first_row: int, slot: int) -> torch.Tensor:
    """``base`` plus rows first_row..first_row+slot (the producing block's slots 0..slot)."""
    visible = base.clone()
    visible[first_row: first_row + slot + 1] = True
    return visible


@dataclass
class ChainRecord:
    """Block 1's greedy chain of one call, to score the rank head against the verifier."""

    logits: torch.Tensor  # [K, V_d] block-1 slot logits
    buckets: list[int]  # predicted buckets
    nodes: list[int] = field(default_factory=list)  # trie ids of g_0..g_{K-1}
    tree_index: dict[int, int] = field(default_factory=dict)  # trie id -> tree node (kept ones)
    hidden: torch.Tensor | None = None  # [K, H] RMSNorm(h^L) per slot (what lm_head and the rank head read)
    position: int = -1  # committed index j whose pair (taps j, token j+1) started block 1

    def first_miss(self, result: VerifyResult, chain_tokens: list[int]) -> int | None:
        """The first slot whose greedy token is not what the target committed, given every earlier
        greedy token was accepted (None if the whole chain was accepted or the prefix diverged)."""
        accepted = list(result.accepted)
        for k in range(len(self.nodes)):
            if k >= len(result.committed) or accepted[:k] != [self.tree_index.get(n, -2) for n in self.nodes[:k]]:
                return None
            if result.committed[k] != chain_tokens[k]:
                return k
        return None


class RankStats:
    """Predicted-bucket frequencies and the confusion matrix of block-1 slots whose greedy prefix
    the target accepted (the valid-prefix positions of the paper's Table 3), at inference."""

    def __init__(self) -> None:
        self.predicted = [0] * NUM_BUCKETS
        self.confusion = [[0] * NUM_BUCKETS for _ in range(NUM_BUCKETS)]  # [true][predicted]

    def observe(self, chain: ChainRecord, result: VerifyResult, draft_index: torch.Tensor) -> None:
        for bucket in chain.buckets:
            self.predicted[bucket] += 1
        accepted = list(result.accepted)
        for k, bucket in enumerate(chain.buckets):
            prefix = [chain.tree_index.get(n, -2) for n in chain.nodes[:k]]
            if accepted[:k] != prefix or k >= len(result.committed):
                break
            draft_id = int(draft_index[result.committed[k]])
            if draft_id < 0:
                true = NUM_BUCKETS - 1  # outside the draft vocabulary: unreachable, like rank > 10
            else:
                logits = chain.logits[k]
                true = int(rank_to_bucket((logits > logits[draft_id]).sum() + 1))
            self.confusion[true][bucket] += 1

    def summary(self) -> dict:
        return {"rank_predicted": self.predicted, "rank_confusion": self.confusion}


class _Trie:
    """Draft nodes keyed by (parent, token): adding an existing pair returns that node (keeping
    the better score), so duplicate siblings merge and their descendants stay reachable."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.index: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int, score: float) -> int:
        key = (parent, token)
        if key in self.index:
            i = self.index[key]
            self.nodes[i].score = max(self.nodes[i].score, score)
            return i
        self.nodes.append(_Node(parent, token, score))
        self.index[key] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def __len__(self) -> int:
        return len(self.nodes)


# ---- registered variants (the paper's Table 2, base-architecture half) ------------------------
class SpecBlockNoBroadcast(SpecBlockDrafter):
    """Drafter trained without the prefix broadcast (slots k > 0 get only their position query)."""

    weights_name = "specblock-no-broadcast"
    label = "SpecBlock – prefix broadcast"
    family = "specblock"
    ablation_of = "specblock"
    trained_with = {"prefix_broadcast": False}


class SpecBlockNoShift(SpecBlockDrafter):
    """Drafter trained without the layer-wise shift."""

    weights_name = "specblock-no-shift"
    label = "SpecBlock – layer-wise shift"
    family = "specblock"
    ablation_of = "specblock"
    trained_with = {"layer_shift": False}


class SpecBlockNoValidPrefix(SpecBlockDrafter):
    """Drafter trained without the valid-prefix mask (every slot supervised)."""

    weights_name = "specblock-no-valid-prefix"
    label = "SpecBlock – valid-prefix curriculum"
    family = "specblock"
    ablation_of = "specblock"
    trained_with = {"valid_prefix": False}


@dataclass
class UniformTreeOptions(SpecBlockOptions):
    uniform_width: int = 3  # fixed top-3 at every slot, same node budget, rank head unused


class SpecBlockUniformTree(SpecBlockDrafter):
    """The full SpecBlock drafter with rank-guided branching replaced by a fixed top-k tree."""

    Options = UniformTreeOptions
    label = "SpecBlock – rank-guided branching"
    family = "specblock"
    ablation_of = "specblock"
