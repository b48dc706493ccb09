"""Self-speculation over the target's first l layers: draft with layers [0, l), verify with [l, L).

A drafter that reads the target's own shallow states calls ``forward_shallow``: layers [0, l) run
on the drafted tokens, their keys/values go into those layers' cache (exactly what the full model
would write there) and the layer-l states are kept in a ``ShallowStates``. The drafter returns that
object on its DraftTree (``DraftTree.shallow``); the engine hands it to ``Target.verify`` as an
argument. If the states cover exactly the verified rows (a chain [root, drafts...]), ``verify_deep``
runs only layers [l, L) on them, so the verifier is still the whole frozen model; otherwise
``discard`` drops the shallow rows and the whole model runs. Nothing is left on the target between
calls: the cache's extra rows in layers [0, l) are always accounted for by the states object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from specbench.engine import kvcache
from specbench.errors import SpecbenchError
from specbench.engine.timing import NULL_TIMER, PhaseTimer

if TYPE_CHECKING:
    from specbench.engine.target import CompiledTree, Target, TargetOutput

SPLIT_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # decoders whose layers can be run one by one here


@dataclass(eq=False)
class ShallowStates:
    """Drafted tokens run through the target's layers [0, ``layer``) only, after its committed
    prefix: their keys/values sit in those layers' cache, their layer-``layer`` states here."""

    layer: int
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def covers(self, compiled: "CompiledTree", taps: Sequence[int] = ()) -> bool:
        """True if these states are exactly the rows [root, chain...] of ``compiled`` and every
        requested tap lies at or above the split layer."""
        tree = compiled.tree
        return (tree.is_chain and self.tokens == [compiled.root] + tree.token_list
                and all(t < 0 or t >= self.layer for t in taps))


def check_split(target: "Target", layer: int) -> None:
    """Raise a one-line SpecbenchError unless ``target`` can be split at ``layer``."""
    _parts(target, layer)


def _parts(target: "Target", layer: int):
    """(embed, layers, final norm) of a decoder that can be run layer by layer."""
    kind = getattr(target.config, "model_type", "")
    if kind not in SPLIT_MODEL_TYPES:
        raise SpecbenchError(f"splitting the target at a layer supports {', '.join(SPLIT_MODEL_TYPES)} decoders; "
                             f"this target is {kind or 'unknown'}")
    if not 1 <= layer < target.num_layers:
        raise SpecbenchError(f"split layer {layer} is out of range; use 1..{target.num_layers - 1} for this target")
    inner = target.model.model
    return inner.embed_tokens, inner.layers, inner.norm


def _causal_mask(target: "Target", past: int, q: int) -> torch.Tensor | None:
    """Additive [1, 1, q, past+q] causal mask; None for one query row (it sees everything)."""
    if q == 1:
        return None
    allowed = torch.ones(q, past + q, dtype=torch.bool, device=target.device).tril(diagonal=past)
    mask = torch.zeros(q, past + q, dtype=target.dtype, device=target.device)
    mask.masked_fill_(~allowed, torch.finfo(target.dtype).min)
    return mask[None, None]


def _run_layers(target: "Target", hidden: torch.Tensor, start: int, layers, mask) -> list[torch.Tensor]:
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


def forward_shallow(target: "Target", states: ShallowStates, token_ids: Sequence[int],
                    timer: PhaseTimer = NULL_TIMER) -> torch.Tensor:
    """Run layers [0, states.layer) on tokens that follow the committed prefix and the rows
    already in ``states``; their keys/values go into those layers' cache only. Appends to
    ``states`` and returns layer ``states.layer``'s input states (HF ``hidden_states[layer]``),
    [n, H]. Timed as a drafter forward."""
    embed, layers, _ = _parts(target, states.layer)
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("forward_shallow needs at least one token")
    start = target.length + len(states.tokens)
    if target.cache_length() != start:
        raise ValueError(f"the cache holds {target.cache_length()} rows, expected {start}: shallow rows of "
                         "another ShallowStates are pending")
    if start + len(ids) > target.max_context:
        raise SpecbenchError(f"generation ran past the target's context window ({target.max_context} tokens); "
                             "lower --max-new-tokens")
    with torch.inference_mode(), timer.forward("drafter"):
        x = embed(torch.tensor([ids], device=target.device))[0]
        hidden = _run_layers(target, x, start, layers[:states.layer], _causal_mask(target, start, len(ids)))[-1]
    states.tokens.extend(ids)
    states.hidden.append(hidden)
    return hidden


def verify_deep(target: "Target", compiled: "CompiledTree", states: ShallowStates, taps: Sequence[int] = (),
                timer: PhaseTimer = NULL_TIMER) -> "TargetOutput":
    """Verify a chain whose rows [root, nodes...] ``states`` already ran through layers [0, l):
    run layers [l, L) on their layer-l states. Taps must be hidden_states indices >= l (or -1).
    Same logits as a whole-model forward; timed as a target forward."""
    from specbench.engine.target import TargetOutput

    layer = states.layer
    _, layers, norm = _parts(target, layer)
    if not states.covers(compiled):
        raise ValueError("verify_deep takes the chain [root, nodes...] the shallow states ran on")
    wanted = {i: (i if i >= 0 else target.num_layers + 1 + i) for i in taps}
    if any(j < layer or j > target.num_layers for j in wanted.values()):
        raise ValueError(f"taps {list(taps)} are not available above layer {layer}")
    hidden = torch.cat(states.hidden)
    with torch.inference_mode(), timer.forward("target"):
        outs = _run_layers(target, hidden, target.length, layers[layer:],
                           _causal_mask(target, target.length, hidden.shape[0]))
        final = norm(outs[-1])
        logits = target.model.get_output_embeddings()(final)
    states_at = outs[:-1] + [final]  # index j - layer = hidden_states[j]; the last entry is normed (HF)
    return TargetOutput(logits, {i: states_at[j - layer] for i, j in wanted.items()})


@torch.inference_mode()  # caches filled under inference_mode may only be edited inside it
def discard(target: "Target", states: ShallowStates) -> None:
    """Drop the shallow rows from layers [0, l) of the cache (drafts not verified as drafted)."""
    cache, length, upto = target.cache, target.length, states.layer
    if hasattr(cache, "layers"):
        for layer in cache.layers[:upto]:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    else:  # transformers < 4.54
        for i in range(upto):
            cache.key_cache[i] = cache.key_cache[i][:, :, :length]
            cache.value_cache[i] = cache.value_cache[i][:, :, :length]
