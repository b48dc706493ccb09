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


def layer_config(raw: dict) -> dict:
    """``transformer_layer_config`` with its class defaults filled in: speculators saves it with
    ``to_diff_dict``, which drops every value equal to the class default (a 4096-wide Llama layer
    has no hidden_size in the file); without a model_type it is a Qwen3 layer, as speculators reads it."""
    from transformers import AutoConfig

    layer = dict(raw.get("transformer_layer_config") or {})
    kind = layer.pop("model_type", "qwen3")
    return {**AutoConfig.for_model(kind, **layer).to_dict(), "model_type": kind}


def speculators_eagle3(raw: dict, folder: Path, num_target_layers: int) -> tuple[dict, tuple[int, ...] | None]:
    """(a flat EAGLE-3 config.json dict, the taps as HF hidden_states indices or None for the default)."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise SpecbenchError(f"{folder} is a speculators {kind!r} drafter, not EAGLE-3; pass it to that method")
    layer = layer_config(raw)
    if layer["model_type"] != "llama":
        raise SpecbenchError(f"{folder} is a speculators EAGLE-3 drafter with a {layer.get('model_type')!r} decoder "
                             "layer; specbench's EAGLE-3 runs the Llama layer only")
    if layer["num_hidden_layers"] != 1:
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


def speculators_dflash(raw: dict, folder: Path, num_target_layers: int) -> dict:
    """A speculators DFlash config.json as z-lab's layout (which our DFlash loader reads): the layer under
    ``transformer_layer_config``; ``aux_hidden_state_layer_ids`` are HF hidden_states indices, z-lab's
    ``target_layer_ids`` the layer before (speculators' own z-lab converter adds the 1). ``dflash2`` is
    passed through untouched, for the DFlash loader's DFlash-2 refusal."""
    kind = raw.get("speculators_model_type")
    if kind == "dflash2":
        return raw
    if kind != "dflash":
        raise SpecbenchError(f"{folder} is a speculators {kind!r} drafter, not DFlash; pass it to that method")
    layer = layer_config(raw)
    if raw.get("draft_vocab_size") not in (None, layer.get("vocab_size")):
        raise SpecbenchError(f"{folder} is a speculators DFlash drafter over a reduced vocabulary of "
                             f"{raw['draft_vocab_size']} tokens (its own lm_head and d2t), which specbench's DFlash "
                             "loader does not read; use a full-vocabulary drafter")
    if raw.get("sample_from_anchor"):
        raise SpecbenchError(f"{folder} is a speculators DFlash drafter with sample_from_anchor (it drafts the anchor "
                             "slot too), which specbench's DFlash does not run")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise SpecbenchError(f"{folder} is a speculators DFlash drafter with sliding_attention layers, whose window "
                             "counts from the block's anchor (z-lab's from each query); specbench runs z-lab's")
    ids = raw.get("aux_hidden_state_layer_ids")
    if not ids:
        raise SpecbenchError(f"{folder} is a speculators DFlash drafter without aux_hidden_state_layer_ids; fix the "
                             "config")
    extra = {"target_layer_ids": [int(i) - 1 for i in ids], "mask_token_id": raw.get("mask_token_id"),
             "block_size": raw.get("block_size", 8)}
    return {**layer, "num_target_layers": num_target_layers, "dflash_config": extra}
