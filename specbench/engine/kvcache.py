"""KV-cache surgery shared by the target and drafters that keep their own cache.

Works on both ``DynamicCache`` layouts: ``cache.layers[i].keys`` (transformers >= 4.54) and
``cache.key_cache[i]`` (older). We slice tensors ourselves instead of ``DynamicCache.crop``,
whose sign convention changed across versions.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def cache_keyword(forward) -> str:
    """The keyword a model or layer ``forward`` takes its cache by: ``cache`` in newer transformers
    (which deprecate ``past_key_values`` and will drop it, after which the cache would be silently
    ignored), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_arg(module: torch.nn.Module, cache) -> dict:
    """``{keyword: cache}`` for calling ``module`` (a model or a decoder layer) with ``cache``."""
    return {cache_keyword(type(module).forward): cache}


def seq_length(cache) -> int:
    return int(cache.get_seq_length())


def pairs(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer, [B, heads, S, d] each, on both layouts."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.54


def _compact(t: torch.Tensor, start: int, rows: torch.Tensor | None, new_len: int) -> torch.Tensor:
    if rows is None:
        return t[:, :, :new_len]
    # A copy, so the in-place write below cannot alias; rows move to this layer's device (a
    # device_map target keeps each layer's cache on that layer's GPU).
    kept = t.index_select(2, rows.to(t.device) + start)
    t = t[:, :, :new_len]
    t[:, :, start:new_len] = kept
    return t


@torch.inference_mode()  # caches filled under inference_mode may only be edited inside it
def compact(cache, start: int, rows: torch.Tensor | None, new_len: int) -> None:
    """Keep positions [0, start) plus, at start.., the speculative ``rows`` (offsets from start);
    ``rows=None`` is a plain truncation to ``new_len``."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            layer.keys = _compact(layer.keys, start, rows, new_len)
            layer.values = _compact(layer.values, start, rows, new_len)
    else:  # transformers < 4.54
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = _compact(cache.key_cache[i], start, rows, new_len)
            cache.value_cache[i] = _compact(cache.value_cache[i], start, rows, new_len)
    if hasattr(cache, "_seen_tokens"):
        cache._seen_tokens = new_len


def truncate(cache, new_len: int) -> None:
    if seq_length(cache) > new_len:
        compact(cache, 0, None, new_len)
