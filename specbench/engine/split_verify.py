"""The layer hook for self-speculation: draft with the target's own first layers, verify with the rest.

``Target.run_layers(tokens, upto=l)`` is the hook any self-speculative drafter uses (a draft head on an
early layer, layer skipping with the first layers kept, ...): layers [0, l) run on tokens that follow
the committed prefix, their keys/values go into those layers' cache (exactly what the whole model would
write there) and their layer-l states (HF ``hidden_states[l]``) come back to the drafter. The target
keeps these pending rows in a ``LayerRows`` beside its cache. When the next ``verify`` is over exactly
the rows [root, chain...] they cover, ``finish`` runs only layers [l, L) on their states, so the
verifier is still the whole frozen model; any other verify ``discard``s them and runs the whole model.

This module holds the layer arithmetic; it takes the target as an argument and imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specbench.engine import kvcache
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.engine.tree import DraftTree
from specbench.errors import SpecbenchError

SPLIT_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # decoders whose layers can be run one by one here


@dataclass(eq=False)
class LayerRows:
    """Tokens run through the target's layers [0, ``layer``) only, after its committed prefix: their
    keys/values sit in those layers' cache, their layer-``layer`` states here."""

    layer: int
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def covers(self, root: int, tree: DraftTree, taps: Sequence[int] = ()) -> bool:
        """True if these rows are exactly [root, chain...] of ``tree`` and every requested tap lies at
        or above the split layer (taps below it were never computed for these rows)."""
        return (tree.is_chain and self.tokens == [root] + tree.token_list
                and all(t < 0 or t >= self.layer for t in taps))


def check_split(target, layer: int) -> None:
    """Raise a one-line SpecbenchError unless ``target`` can be split at ``layer``."""
    _parts(target, layer)


def _parts(target, layer: int):
    """(embed, layers, final norm) of a decoder that can be run layer by layer."""
    kind = getattr(target.config, "model_type", "")
    if kind not in SPLIT_MODEL_TYPES:
        raise SpecbenchError(f"splitting the target at a layer supports {', '.join(SPLIT_MODEL_TYPES)} decoders; "
                             f"this target is {kind or 'unknown'}")
    if not 1 <= layer < target.num_layers:
        raise SpecbenchError(f"split layer {layer} is out of range; use 1..{target.num_layers - 1} for this target")
    inner = target.model.model
    return inner.embed_tokens, inner.layers, inner.norm


def _causal_mask(target, past: int, q: int) -> torch.Tensor | None:
    """Additive [1, 1, q, past+q] causal mask; None for one query row (it sees everything). The compiled
    engine's static cache: the mask over its whole width, its writes pointed at past.. (``causal_rows``)."""
    if target.static is not None:
        return target.static.causal_rows(past, q)
    if q == 1:
        return None
    allowed = torch.ones(q, past + q, dtype=torch.bool, device=target.device).tril(diagonal=past)
    mask = torch.zeros(q, past + q, dtype=target.dtype, device=target.device)
    mask.masked_fill_(~allowed, torch.finfo(target.dtype).min)
    return mask[None, None]


def _run_layers(target, hidden: torch.Tensor, start: int, layers, mask) -> list[torch.Tensor]:
    """Run decoder ``layers`` on [q, H] rows at positions start.., appending to their caches
    (each layer writes its own cache slot). Returns the input and every layer's output."""
    x = hidden.unsqueeze(0)
    positions = torch.arange(start, start + x.shape[1], device=target.device).unsqueeze(0)
    rope = target.model.model.rotary_emb(x, position_ids=positions)
    outs = [hidden]
    for layer in layers:
        x = layer(x, attention_mask=mask, position_ids=positions, use_cache=True, position_embeddings=rope,
                  **kvcache.cache_arg(layer, target.cache))
        outs.append(x[0])
    return outs


def run_first_layers(target, rows: LayerRows, token_ids: Sequence[int],
                     timer: PhaseTimer = NULL_TIMER) -> torch.Tensor:
    """Run layers [0, rows.layer) on tokens that follow the committed prefix and ``rows``; their
    keys/values go into those layers' cache only. Appends to ``rows`` and returns layer
    ``rows.layer``'s input states (HF ``hidden_states[layer]``), [n, H]. Timed as a drafter forward."""
    embed, layers, _ = _parts(target, rows.layer)
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("run_layers needs at least one token")
    start = target.length + len(rows.tokens)
    if target.cache_length() != start:
        raise ValueError(f"the cache holds {target.cache_length()} rows, expected {start}")
    if start + len(ids) > target.max_context:
        raise SpecbenchError(f"generation ran past the target's context window ({target.max_context} tokens); "
                             "lower --max-new-tokens")
    with torch.inference_mode(), timer.forward("drafter"):
        x = embed(torch.tensor([ids], device=target.device))[0]
        hidden = _run_layers(target, x, start, layers[:rows.layer], _causal_mask(target, start, len(ids)))[-1]
    rows.tokens.extend(ids)
    rows.hidden.append(hidden)
    if target.static is not None:
        target.cache.rows = start + len(ids)
    return hidden


def finish(target, rows: LayerRows, taps: Sequence[int] = (),
           timer: PhaseTimer = NULL_TIMER) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(logits, taps) of the rows [root, chain...] that ``rows`` already ran through layers [0, l):
    layers [l, L) run on their layer-l states. Taps must be hidden_states indices >= l (or -1).
    Same logits as a whole-model forward; timed as a target forward."""
    layer = rows.layer
    _, layers, norm = _parts(target, layer)
    wanted = {i: (i if i >= 0 else target.num_layers + 1 + i) for i in taps}
    if any(j < layer or j > target.num_layers for j in wanted.values()):
        raise ValueError(f"taps {list(taps)} are not available above layer {layer}")
    hidden = torch.cat(rows.hidden)
    with torch.inference_mode(), timer.forward("target"):
        outs = _run_layers(target, hidden, target.length, layers[layer:],
                           _causal_mask(target, target.length, hidden.shape[0]))
        final = norm(outs[-1])
        logits = target.model.get_output_embeddings()(final)
    if target.static is not None:
        target.cache.rows = target.length + hidden.shape[0]
    states_at = outs[:-1] + [final]  # index j - layer = hidden_states[j]; the last entry is normed (HF)
    return logits, {i: states_at[j - layer] for i, j in wanted.items()}


@torch.inference_mode()  # caches filled under inference_mode may only be edited inside it
def discard(target, rows: LayerRows) -> None:
    """Drop the pending rows from layers [0, l) of the cache (drafts not verified as drafted)."""
    cache, length, upto = target.cache, target.length, rows.layer
    if target.static is not None:  # rows past the committed prefix are never seen: forget them
        cache.rows = length
    elif hasattr(cache, "layers"):
        for layer in cache.layers[:upto]:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    else:  # transformers < 4.54
        for i in range(upto):
            cache.key_cache[i] = cache.key_cache[i][:, :, :length]
            cache.value_cache[i] = cache.value_cache[i][:, :, :length]
