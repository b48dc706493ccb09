"""vLLM speculators' checkpoint layout, read by our EAGLE-3 loader.

speculators (``speculators_model_type`` in config.json) nests the decoder layer's shapes under
``transformer_layer_config``, names its taps ``eagle_aux_hidden_state_layer_ids`` at the top level
as vLLM collects them (the INPUT of layer i, i.e. HF ``hidden_states[i]``; SpecForge's ids of the
same name under ``eagle_config`` are layer outputs, ``hidden_states[i + 1]``), and stores the decoder
layer as ``layers.0.*`` where the EAGLE-3 layout has ``midlayer.*``. Variants our drafter does not
run are refused in one line naming the flag.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specbench.errors import SpecbenchError

# speculators flags (Eagle3SpeculatorConfig) that change the forward in ways our EAGLE-3 drafter lacks.
UNSUPPORTED_FLAGS = {
    "norm_before_residual": "the residual stream taken after hidden_norm",
    "norm_before_fc": "one RMSNorm over the concatenated taps before fc",
    "norm_output": "the final norm's output fed back across drafting steps (EAGLE 3.1)",
}


def is_speculators(raw: dict) -> bool:
    return "speculators_model_type" in raw


def speculators_eagle3(raw: dict, folder: Path, num_target_layers: int) -> tuple[dict, tuple[int, ...] | None]:
    """(a flat EAGLE-3 config.json dict, the taps as HF hidden_states indices or None for the default)."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise SpecbenchError(f"{folder} is a speculators {kind!r} drafter, not EAGLE-3; pass it to that method")
    layer = raw.get("transformer_layer_config") or {}
    if layer.get("model_type", "llama") != "llama":
        raise SpecbenchError(f"{folder} is a speculators EAGLE-3 drafter with a {layer.get('model_type')!r} decoder "
                             "layer; specbench's EAGLE-3 runs the Llama layer only")
    if layer.get("num_hidden_layers", 1) != 1:
        raise SpecbenchError(f"{folder} is a speculators EAGLE-3 drafter with {layer['num_hidden_layers']} decoder "
                             "layers; specbench's EAGLE-3 runs one")
    flags = [f"{name} ({what})" for name, what in UNSUPPORTED_FLAGS.items() if raw.get(name)]
    if flags:
        raise SpecbenchError(f"{folder} is a speculators EAGLE-3 drafter with {', '.join(flags)}, which specbench's "
                             "EAGLE-3 does not run")
    flat = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"), "fc_norm": bool(raw.get("fc_norm")),
            "norm_output": True}  # speculators always scores lm_head(norm(h)) (see UNSUPPORTED_FLAGS)
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return flat, None
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_target_layers]
    if bad or not ids:
        raise SpecbenchError(f"{folder} taps target hidden states {ids}, outside 0..{num_target_layers - 1}; use the "
                             "drafter published for this target")
    return flat, tuple(ids)


def speculators_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' ``layers.0.*`` -> the EAGLE-3 layout's ``midlayer.*`` (other keys are shared)."""
    return {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
