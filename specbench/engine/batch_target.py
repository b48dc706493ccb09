"""The target verifying a batch of requests: every request's tree in ONE forward over a ragged cache.

Each request keeps its own topology and its own positions: its rows [root, nodes...] are packed into
one [B, Q] block (Q = the largest tree + 1; a smaller tree is padded with extra root children that
nobody sees), with position ids from its own length (``RaggedCache.lengths``) plus the node depth, and
a [B, 1, Q, width + Q] additive mask in which a row sees its request's committed columns and its own
ancestors in the block, never a dead column or another request's rows (batch_cache.py has the layout).

The engine times ``compile_batch`` as ``compile`` and the forward as ``verify``, as for batch 1. The
same packing serves drafters that run an HF model over ragged feeds (``pack_rows`` with chains).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specbench.engine import kvcache
from specbench.engine.batch_cache import RaggedCache
from specbench.engine.target import Target, TargetOutput
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.engine.tree import DraftTree
from specbench.errors import SpecbenchError


def batch_visibility(parents: torch.Tensor) -> torch.Tensor:
    """[B, N+1, N+1] bool over rows/cols [root, nodes...] of each request from parents [B, N] (-1: a
    child of the root): ``tree.verify_visibility`` batched, the same repeated squaring on the device."""
    b, n = parents.shape
    reach = torch.zeros(b, n, n, dtype=torch.float32, device=parents.device)
    reach.scatter_(2, parents.clamp(min=0).unsqueeze(2), (parents >= 0).float().unsqueeze(2))
    reach += torch.eye(n, device=parents.device)
    for _ in range(max(0, (n - 1).bit_length())):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    visible = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    visible[:, :, 0] = True
    visible[:, 1:, 1:] = reach > 0
    return visible


@dataclass(eq=False)
class PackedRows:
    """One forward's inputs for B requests (on the model's device) and what the walk needs back."""

    width: int  # the cache's physical length it was packed against
    rows: list[int]  # real rows per request (root + nodes); the rest of its Q are padding
    ids: torch.Tensor  # [B, Q]
    positions: torch.Tensor  # [B, Q]
    mask: torch.Tensor | None  # additive [B, 1, Q, width + Q]; None: one request's chain (the causal kernel)
    trees: list[DraftTree] | None = None  # the target's compile: the trees the walk follows


def pack_rows(blocks: Sequence[tuple[Sequence[int], Sequence[int]]], cache: RaggedCache, device: torch.device,
              dtype: torch.dtype) -> PackedRows:
    """``blocks[b]`` = (ids [root, nodes...], parents of the nodes, -1 = the root) for every cache row.
    One host->device copy; depths, positions and the mask are derived on the device."""
    if len(blocks) != len(cache):
        raise ValueError(f"{len(blocks)} blocks for a cache of {len(cache)} requests")
    q = max(len(ids) for ids, _ in blocks)
    if len(blocks) == 1 and cache.width == cache.lengths[0] and list(blocks[0][1]) == list(range(-1, q - 2)):
        # One request, a chain, no dead column: batch 1's own forward (the causal kernel, no mask), so that the
        # batched loop at B = 1 computes what the one-request loop computes, rounding included.
        ids = torch.as_tensor([list(blocks[0][0])]).to(device)
        positions = torch.arange(cache.width, cache.width + q, device=device)[None]
        return PackedRows(cache.width, [q], ids, positions, None)
    host = torch.empty(len(blocks), 2 * q - 1, dtype=torch.long)
    for b, (ids, parents) in enumerate(blocks):
        n = len(ids)
        host[b, :n] = torch.as_tensor(list(ids))
        host[b, n:q] = ids[0]  # padding: copies of the root, children of the root, seen by no real row
        host[b, q: q + n - 1] = torch.as_tensor(list(parents), dtype=torch.long)
        host[b, q + n - 1:] = -1
    packed = host.to(device)
    ids, parents = packed[:, :q], packed[:, q:]
    visible = batch_visibility(parents)
    lengths = torch.tensor(cache.lengths, device=device)
    positions = lengths[:, None] + visible.sum(2) - 1
    see = torch.cat([cache.live(device)[:, None, :].expand(-1, q, -1), visible], 2)
    mask = torch.zeros(see.shape, dtype=dtype, device=device).masked_fill_(~see, torch.finfo(dtype).min)
    return PackedRows(cache.width, [len(ids) for ids, _ in blocks], ids, positions, mask[:, None])


def forward_rows(model, cache: RaggedCache, packed: PackedRows, taps: Sequence[int] = (),
                 timer: PhaseTimer = NULL_TIMER, owner: str = "target"):
    """ONE forward of an HF causal LM over the packed rows; appends them to every cache row at
    ``packed.width`` (``RaggedCache.commit`` then keeps what each request accepted)."""
    if cache.width != packed.width:
        raise ValueError(f"rows packed at cache width {packed.width}, the cache is {cache.width} wide")
    kwargs = dict(input_ids=packed.ids, position_ids=packed.positions, attention_mask=packed.mask, use_cache=True,
                  output_hidden_states=bool(taps), **kvcache.cache_arg(model, cache.cache))
    with torch.inference_mode(), timer.forward(owner):
        return model(**kwargs)


class BatchTarget:
    """The target's side of a batched decode: a ragged cache of the active requests, in row order.

    ``join`` prefills one prompt exactly as batch 1 does (``Target.prefill``, so its first token and
    taps are batch 1's) and appends its cache as a new row; ``leave`` drops finished rows."""

    def __init__(self, target: Target) -> None:
        if target.static is not None:  # its ragged cache takes each request's DynamicCache from the target
            raise SpecbenchError("batched decoding runs with the eager engine; load the target with engine='eager'")
        self.target = target
        self.cache = RaggedCache()

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def join(self, prompt_ids: Sequence[int], taps: Sequence[int] = ()) -> TargetOutput:
        out = self.target.prefill(prompt_ids, taps=taps)
        self.cache.add(self.target.cache, self.target.length)
        self.target.reset()  # the batch cache owns those tensors now; the target's own cache starts empty
        return out

    def leave(self, rows: Sequence[int]) -> None:
        self.cache.remove(rows)

    def compile_batch(self, roots: Sequence[int], trees: Sequence[DraftTree]) -> PackedRows:
        """The verify inputs of every request's rows [root, nodes...] (the engine's ``compile`` phase)."""
        limit = self.target.max_context
        for length, tree in zip(self.cache.lengths, trees):
            if length + len(tree) + 1 > limit:
                raise SpecbenchError(f"generation ran past the target's context window ({limit} tokens); "
                                     "lower --max-new-tokens")
        blocks = []
        for root, tree in zip(roots, trees):
            tree.children  # noqa: B018 - the walk's child table, built here for every method alike
            blocks.append(([root, *tree.token_list], tree.parent_list))
        packed = pack_rows(blocks, self.cache, self.target.device, self.target.dtype)
        packed.trees = list(trees)
        return packed

    def verify(self, packed: PackedRows, taps: Sequence[int] = (),
               timer: PhaseTimer = NULL_TIMER) -> list[TargetOutput]:
        """ONE forward over every request's rows; per request, the logits and taps of its real rows."""
        with self.target._attention(self.target.chain_attn if packed.mask is None else None):
            out = forward_rows(self.target.model, self.cache, packed, taps, timer)
        return [TargetOutput(out.logits[b, :n], {i: out.hidden_states[i][b, :n] for i in taps})
                for b, n in enumerate(packed.rows)]

    def commit(self, packed: PackedRows, kept: Sequence[Sequence[int]]) -> None:
        """Keep verify rows ``kept[b]`` (row 0 = the root) of every request at its length, drop the rest."""
        if any(not rows or rows[0] != 0 for rows in kept):
            raise ValueError("commit rows must start with row 0 (the root)")
        self.cache.commit(packed.width, kept)
