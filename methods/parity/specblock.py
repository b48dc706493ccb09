"""SpecBlock's drafter side against the authors' own draft model: ``SpecBlockInferenceModel`` of their
benchmark harness (github.com/shiweijiezero/SpecBlock, ``benchmarks_hf/algorithms/``), imported at run
time from a checkout of their repository (specbench/run/snapshots.py); nothing of it is copied here.

Their whole loop (``benchmarks_hf/algorithms/specblock.py``) times itself with CUDA events, builds its
tree with Triton/CUDA kernels and pins transformers 4.57.6, so it does not run here. Their draft model
runs in plain torch on a CPU, so the reference is the drafter side, as for DDTree's drafter row: their
model, holding our drafter's weights, computes every block's logits, rank logits and last-layer states
inside our engine (our rank-guided tree, our tree verify). Identical drafts give identical per-step
accept lengths and text; the speed ratio compares their forwards and cross cache with ours.

* Block 1: their ``update_cache_and_draft`` encodes the newly committed pairs into their cross cache and
  drafts block 1 in the same forward, as their loop does. In the ``duplicate`` convention (their
  inference code's, and this row's default: both sides run it) the last pair goes in twice, as their
  ``prefill_and_draft`` feeds it, and their ``pop_cache`` takes the copy back out (their block 2 reads
  the cache without it too); in ``once`` (ours) the last pair's group is block 1 and stays.
* Block 2+: their ``forward_with_cache`` with their cross cache (the rows every start sees) and the
  current iteration's block rows as their ``ttt_cache`` under a per-start ``ttt_mask``, batched over
  the starts as their tree builder calls it.

Our weights go into their layout with every key accounted for; our rank head (``rank_hidden`` wide) is
zero-padded to their fixed 256 (an exact embedding: the padded units stay 0 through SiLU and add 0).
Their model has no prefix-broadcast ablation, so such a drafter is refused in one line.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from methods.specblock.drafter import SpecBlockDrafter
from methods.specblock.model import BlockOutput, SpecBlockModel, draft_row_offset
from specbench.errors import SpecbenchError
from specbench.run.parity import ReferenceOutput
from specbench.run.snapshots import Repository, Snapshot, import_snapshot, locate_snapshot

REPOSITORY = Repository(url="https://github.com/shiweijiezero/SpecBlock",
                        licence="Apache-2.0 per its pyproject; the repository has no LICENSE file",
                        env="SPECBENCH_REF_SPECBLOCK", marker="benchmarks_hf/algorithms/specblock_inference_model.py")
HARNESS = "benchmarks_hf"  # their harness's import root: ``algorithms`` is a package under it
PACKAGE = "algorithms"
MODULE = "algorithms.specblock_inference_model"
THEIR_RANK_WIDTH = 256  # their rank head's hidden width, fixed in _SpecBlockInferenceModelBase
DERIVED = ("inv_freq", ".cos", ".sin")  # rotary buffers their class derives from the config


# ---- shims: each one bridges one thing that keeps their code from running here as it is -------------
def harness_package(root) -> types.ModuleType:
    """Their ``algorithms/__init__.py`` imports the benchmark harness (base.py -> utils.prompt ->
    specforge.data -> yunchang, sglang), none of which the draft model uses and which does not install
    on a CPU machine; a bare package module with their folder as its path stands in, so importing
    ``algorithms.specblock_inference_model`` runs only that file and ``_specblock_inference_model_base``."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(root / PACKAGE)]
    package.__package__ = PACKAGE
    return package


@contextmanager
def their_package_importable(package: types.ModuleType) -> Iterator[None]:
    """Their shifted model's ``forward_with_cache`` runs ``from . import _specblock_inference_model_base``
    on every call, which needs their package in ``sys.modules``; ``import_snapshot`` sets their modules
    aside once imported (their top-level name is generic), so each call puts the package back for its
    duration and then restores whatever held the name."""
    held = sys.modules.get(PACKAGE)
    sys.modules[PACKAGE] = package
    try:
        yield
    finally:
        if held is None:
            sys.modules.pop(PACKAGE, None)
        else:
            sys.modules[PACKAGE] = held


# Their attention and cache code pick kernels and cache tricks from environment switches read at every
# call; TREE_ATTN_3WAY defaults on (a Triton kernel) for head_dim 128. Pinned to their plain-torch path,
# with no stream/compaction tricks, which is the computation their training defines. RANK_TOPK: their
# inference default is 10 (an approximation their code comments on: "rank_head was trained with K=20");
# their training (specforge/modeling/draft/_llama3_specblock_base.py) and ours use the top 20.
THEIR_SWITCHES = {"TREE_ATTN_3WAY": "0", "TREE_ATTN_SDPA": "0", "TREE_ATTN_TRITON": "0", "CACHE_COUNT_BUCKET": "0",
                  "STREAM_CACHE_VARIANT": "off", "STREAM_COMPACT_NEAR_WIN": "0", "STREAM_COMPACT_PROMPT": "0",
                  "STREAM_SNAP_PROMPT": "0", "STATIC_DRAFT_PROFILE_DEEP": "0", "RANK_TOPK": "20"}


@contextmanager
def their_plain_torch_path() -> Iterator[None]:
    """THEIR_SWITCHES set for the duration of a call, the caller's environment restored after."""
    saved = {key: os.environ.get(key) for key in THEIR_SWITCHES}
    os.environ.update(THEIR_SWITCHES)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- their model with our weights ---------------------------------------------------------------
def load_authors_module(snapshot: Snapshot) -> tuple[types.ModuleType, types.ModuleType]:
    """(their ``specblock_inference_model`` module, the package module it runs under)."""
    root = snapshot.path / HARNESS
    package = harness_package(root)
    modules = import_snapshot(replace(snapshot, path=root), [MODULE], tops=(PACKAGE,), stubs={PACKAGE: package})
    return modules[MODULE], package


def authors_config(model: SpecBlockModel) -> types.SimpleNamespace:
    """Their model reads its config by attribute (``getattr`` with defaults): ours, in their names."""
    cfg = model.config
    return types.SimpleNamespace(
        hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        num_hidden_layers=cfg.num_layers, hidden_act=cfg.hidden_act, rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size, diffspec_draft_token_num=cfg.block_size,
        rank_classes=4, max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling)


def check_expressible(model: SpecBlockModel, name: str) -> None:
    """One line when their model cannot hold this drafter."""
    cfg = model.config
    why = None
    if not cfg.prefix_broadcast:
        why = "their model always broadcasts the prefix (no ablation switch)"
    elif cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        why = (f"their attention derives head_dim as hidden/heads ({cfg.hidden_size}/{cfg.num_attention_heads}), "
               f"this drafter's is {cfg.head_dim}")
    elif cfg.rank_hidden > THEIR_RANK_WIDTH:
        why = f"their rank head is {THEIR_RANK_WIDTH} wide, ours {cfg.rank_hidden}"
    elif cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) != "llama3":
        why = f"their rotary embedding knows llama3 scaling only (this drafter has {cfg.rope_scaling})"
    if why:
        raise SpecbenchError(f"{name}: the authors' SpecBlockInferenceModel cannot hold this drafter: {why}")


def authors_state(model: SpecBlockModel) -> dict[str, torch.Tensor]:
    """Our state dict in their layout: the target's token embedding (theirs holds a copy), the rank head
    zero-padded to their width, every other key by the same name."""
    state = {k: v for k, v in model.state_dict().items()}
    width = model.config.rank_hidden
    first, second = state["rank_head.0.weight"], state["rank_head.2.weight"]
    state["rank_head.0.weight"] = torch.cat([first, first.new_zeros(THEIR_RANK_WIDTH - width, first.shape[1])])
    state["rank_head.2.weight"] = torch.cat([second, second.new_zeros(second.shape[0], THEIR_RANK_WIDTH - width)], 1)
    # the target's embedding, which our model references without saving it
    state["input_layer.embed_tokens.weight"] = model._embedding[0].weight.detach()
    return state


def authors_draft_model(their, model: SpecBlockModel, name: str):
    """Their ``SpecBlockInferenceModel`` (or, for a drafter without the layer-wise shift, its base class,
    which has none) holding our drafter's weights, same dtype and device."""
    check_expressible(model, name)
    cls = their.SpecBlockInferenceModel if model.config.layer_shift else their._SpecBlockInferenceModelBase
    ref = cls(authors_config(model))
    missing, unexpected = ref.load_state_dict(authors_state(model), strict=False)
    missing = [k for k in missing if not k.endswith(DERIVED)]
    if missing or unexpected:
        raise SpecbenchError(f"{name}: the authors' SpecBlockInferenceModel rejects this drafter's layout (it lacks "
                             f"{', '.join(missing[:4]) or 'nothing'}; it has no place for "
                             f"{', '.join(unexpected[:4]) or 'nothing'})")
    param = next(model.parameters())
    return ref.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)


# ---- our drafter, their forwards ------------------------------------------------------------------
class AuthorsForwardSpecBlock(SpecBlockDrafter):
    """SpecBlock whose block forwards are the authors' model's (their cross cache, their block-1 and
    block-2 calls); our rank-guided tree, our options and our engine do the rest."""

    def attach_reference(self, model, package: types.ModuleType) -> None:
        self.ref_model, self.package = model, package

    @contextmanager
    def _theirs(self, state) -> Iterator[None]:
        with state.timer.forward("drafter"), their_package_importable(self.package), their_plain_torch_path():
            yield

    def begin(self, state, prefill) -> None:
        super().begin(state, prefill)
        # their cross cache, sized as their prefill sizes it: [k_buf, v_buf, count, max_len, far_end] per layer
        self.cache = self.ref_model.reset_cache(max_cache_len=(len(state.tokens) + 2048) * self.model.K)
        self.cross_rows = 0  # cache rows every block-2 start sees in full

    def _encode(self, state):
        k = self.model.K
        start = self.encoded
        condition = self.pending[None]
        ids = torch.tensor([state.tokens[start + 1:]], device=self.target.device)
        g = ids.shape[1]
        copy = self.bonus_row == "duplicate"
        if copy:  # the last pair once more, as their prefill_and_draft appends it
            condition = torch.cat([condition, condition[:, -1:]], 1)
            ids = torch.cat([ids, ids[:, -1:]], 1)
        with self._theirs(state):
            logits, rank_logits, hidden, block_kv, _ = self.ref_model.update_cache_and_draft(
                condition, ids, self.cache, start)
            if copy:
                self.ref_model.pop_cache(self.cache)
        self.encoded += g
        self.pending = self.pending[:0]
        count = self.cache[0][2]
        self.cross_rows = count if copy else count - k  # once: block 1's own group is the last K cache rows
        # block 1's keys/values (their "ttt" rows: [1, kv_heads, K, d] per layer) lead the transient rows
        return BlockOutput(hidden, logits, rank_logits, []), list(block_kv), self.cross_rows + k

    def _run_starts(self, state, trie, chosen, transient):
        k = self.model.K
        g = len(chosen)
        device = self.target.device
        visible = torch.stack([s.visible for s in chosen]).to(device)
        cross = self.cross_rows
        if not bool(visible[:, :cross].all()):
            raise AssertionError("a block-2 start must see every cross-cache row in full")
        ttt_mask = visible[:, cross:]
        condition = torch.stack([s.hidden for s in chosen])[:, None]  # [G, 1, H]
        tokens = torch.tensor([[trie.nodes[s.node].token] for s in chosen], device=device)
        # their tree builder's block-2 call: the cache's rows expanded over the starts, the block rows as ttt
        batch_cache = [[c[0][:, :, :cross].expand(g, -1, -1, -1), c[1][:, :, :cross].expand(g, -1, -1, -1), cross]
                       if cross > 0 else [None, None, 0] for c in self.cache]
        ttt = [(key.expand(g, -1, -1, -1), value.expand(g, -1, -1, -1)) for key, value in transient]
        full_mask = torch.cat([ttt_mask.new_ones(g, cross), ttt_mask], 1)
        position_id = self.encoded - 1 + draft_row_offset(self.bonus_row)  # their ids: position_id + 1 + k
        with self._theirs(state):
            logits, rank_logits, hidden, new_kv = self.ref_model.forward_with_cache(
                hidden=condition, input_ids=tokens, cache=batch_cache, position_id=position_id,
                use_draft_condition=True, ttt_cache=ttt, ttt_mask=ttt_mask, update_cross_cache=False,
                full_kv_mask=full_mask)
        # the new rows join the transient ones start-major, as ours do
        transient = [(torch.cat([key, nk.transpose(0, 1).reshape(1, nk.shape[1], g * k, -1)], 2),
                      torch.cat([value, nv.transpose(0, 1).reshape(1, nv.shape[1], g * k, -1)], 2))
                     for (key, value), (nk, nv) in zip(transient, new_kv)]
        out = BlockOutput(hidden.reshape(1, g * k, -1), logits.reshape(1, g * k, -1),
                          rank_logits.reshape(1, g * k, -1), [])
        return out, transient


class SpecBlockAuthorsDrafter:
    name = "specblock"
    repository = REPOSITORY
    source: str | None = None
    reference = "SpecBlock authors' SpecBlockInferenceModel in our loop"
    # Both sides run the authors' inference convention (like with like); --opt bonus_row=once runs ours.
    options = {"bonus_row": "duplicate"}
    notes = ("drafter side only: the authors' loop needs CUDA, Triton and transformers 4.57.6, so their "
             "SpecBlockInferenceModel (plain torch) with our drafter's weights (rank head zero-padded to their 256 "
             "units, exact) computes every block inside our engine: block 1 by their update_cache_and_draft (+ "
             "pop_cache for the copy), later blocks by their forward_with_cache over their cross cache and a per-start "
             "ttt mask; identical drafts check the forwards, the speed ratio compares the drafter forwards and caches. "
             "Both sides run the authors' inference convention, bonus_row=duplicate (the last committed pair encoded "
             "as a context row and again as block 1 one position later, as their prefill_and_draft feeds it), although "
             "the shipped drafter was trained once (ours, the paper's and their training code's): the same computation "
             "on both sides, which is what parity checks. Their rank features are pinned to the top 20 logits (their "
             "training's and ours; their inference default is RANK_TOPK=10) and their attention to its plain-torch "
             "path. Not reproduced, their decode loop's bookkeeping after the first step "
             "(benchmarks_hf/algorithms/_specblock_base.py, generate loop): after a step that accepts tokens it feeds "
             "the hidden states of the root and the accepted tokens with the accepted tokens from the second on and "
             "the bonus twice, so every context row but the copy holds the token two positions ahead, keeps the "
             "previous copy in the cache and starts the new rows' rotary ids one past the last written (draft_position "
             "+ 1); after a step that accepts nothing it drops the copy and drafts the new pair with no context row of "
             "its own. Our loop drafts every step the way their prefill does.")

    def version(self) -> str:
        self.snapshot = locate_snapshot(self.repository, self.source)
        self.reference = f"SpecBlockInferenceModel in our loop, {self.snapshot.describe()}"
        return self.snapshot.commit[:12]

    def load(self, target, drafter, options) -> None:
        their, package = load_authors_module(self.snapshot)
        model = authors_draft_model(their, drafter.model, drafter.name)
        side = AuthorsForwardSpecBlock(options, model=drafter.model)  # our options and weights; their forwards
        side.setup(target)
        side.attach_reference(model, package)
        self.target, self.side = target, side

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        from specbench.engine.loop import GenerationConfig, generate
        from specbench.engine.verify import SamplingParams
        from specbench.run.parity import decode_seconds_of

        record = generate(self.target, self.side, prompt_ids, GenerationConfig(max_new_tokens, SamplingParams(0.0), 0))
        return ReferenceOutput(record.new_tokens, record.accept_lengths, decode_seconds_of(record))
