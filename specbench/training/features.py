"""Target features for training: right-padded batches of regenerated examples with the frozen
target's hidden-state taps, computed on the fly or read from an fp16 disk cache."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from specbench.data.distributed import World, rows_of
from specbench.engine.target import Target
from specbench.training.batch import TrainBatch


def pad_examples(examples: Sequence[dict], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, loss_mask) for prompt+response, truncated to ``max_length``."""
    rows = [(e["prompt_ids"] + e["response_ids"])[:max_length] for e in examples]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for i, (row, e) in enumerate(zip(rows, examples)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        loss[i, len(e["prompt_ids"]): len(row)] = 1  # assistant tokens only
    return ids, attn, loss


@torch.no_grad()  # not inference_mode: autograd must be able to save these as loss inputs
def target_taps(target: Target, ids: torch.Tensor, attn: torch.Tensor, taps: Sequence[int]) -> dict[int, torch.Tensor]:
    """Hidden states of the requested ``hidden_states`` indices (always including -1), fp32."""
    # The transformer body alone: the CausalLM would also project every position onto the full vocabulary
    # (a fifth of the forward for a 49k-token head), logits no trainer reads.
    body = getattr(target.model, "base_model", target.model)
    out = body(input_ids=ids.to(target.device), attention_mask=attn.to(target.device),
               output_hidden_states=True, use_cache=False)
    wanted = sorted(set(taps) | {-1})
    return {i: out.hidden_states[i].float() for i in wanted}


class FeatureCache:
    """Per-example fp16 taps on disk, keyed by example id, tap set, truncation length and the
    dtype the target ran in (pays off from epoch 2)."""

    def __init__(self, folder: str | Path, taps: Sequence[int], max_length: int,
                 target_dtype: torch.dtype = torch.float32) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.taps = sorted(set(taps) | {-1})
        self.max_length = max_length
        # fp32 keys stay as before, so caches filled by earlier runs remain valid.
        self.key_suffix = "" if target_dtype == torch.float32 else f"|{target_dtype}"

    def _path(self, example_id: str) -> Path:
        key = hashlib.sha256(f"{example_id}|{self.taps}|{self.max_length}{self.key_suffix}".encode()).hexdigest()[:20]
        return self.folder / f"{key}.safetensors"

    def get(self, example_id: str) -> dict[int, torch.Tensor] | None:
        path = self._path(example_id)
        if not path.exists():
            return None
        return {int(k): v.float() for k, v in load_file(str(path)).items()}

    def put(self, example_id: str, taps: dict[int, torch.Tensor]) -> None:
        # Write then rename, so runs sharing the cache never read a half-written file.
        path = self._path(example_id)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial")
        save_file({str(k): v.half().contiguous() for k, v in taps.items()}, str(partial))
        os.replace(partial, path)


def iterate_batches(target: Target, examples: Sequence[dict], taps: Sequence[int], batch_size: int, max_length: int,
                    shuffle: bool = True, seed: int = 0, cache: FeatureCache | None = None,
                    world: World | None = None) -> Iterator[TrainBatch]:
    """One pass over ``examples`` as TrainBatches (length-bucketed so padding stays small).

    With ``world`` (data parallel), the same global batches on every rank, of which this rank
    takes rows rank, rank + N, ... (and computes only their taps); a rank with no row of a batch
    gets a ``filler`` batch (weight 0, see ``distributed.rows_of``)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["prompt_ids"]) + len(examples[i]["response_ids"]))
    chunks = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        random.Random(seed).shuffle(chunks)
    for chunk in chunks:
        filler = False
        if world is not None and world.active:
            chunk, filler = rows_of(chunk, world)
        group = [examples[i] for i in chunk]
        ids, attn, loss = pad_examples(group, max_length)
        tapped = _cached_taps(target, group, ids, attn, taps, cache) if cache else target_taps(target, ids, attn, taps)
        batch = TrainBatch(ids, attn, loss, tapped, target.model.get_output_embeddings(), {"ids": [e["id"] for e in group]})
        batch.filler = filler
        yield batch


def _cached_taps(target, group, ids, attn, taps, cache: FeatureCache) -> dict[int, torch.Tensor]:
    stored = [cache.get(e["id"]) for e in group]
    if any(s is None for s in stored):
        fresh = target_taps(target, ids, attn, taps)
        for row, e in enumerate(group):
            n = int(attn[row].sum())
            cache.put(e["id"], {k: v[row, :n] for k, v in fresh.items()})
        return fresh
    width = ids.shape[1]
    out = {}
    for k in stored[0]:
        padded = torch.zeros(len(group), width, stored[0][k].shape[-1])
        for row, s in enumerate(stored):
            padded[row, : s[k].shape[0]] = s[k][:width]
        out[k] = padded
    return out


def token_counts(examples: Sequence[dict], vocab_size: int) -> torch.Tensor:
    """How often each token appears in the responses (for the reduced draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(torch.tensor(e["response_ids"], dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts
