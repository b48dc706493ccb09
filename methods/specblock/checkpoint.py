"""SpecBlock checkpoints: our drafter folders, and the published layout for GPU users
(``config.json`` Llama-style with ``diffspec_draft_token_num``, ``model.safetensors`` with
``input_layer.*`` / ``layers.N.*`` / ``shift_proj.N`` / ``rank_head.*`` keys, ``vocab_mapping.pt``
holding ``t2d`` and ``d2t``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from methods.checkpoints import check_layer_shapes, load_checked, load_ours_or_published, save_ours
from methods.checkpoints import read_published_weights  # whole or sharded weights
from methods.taps import check_taps, eagle3_taps
from methods.layers import official_layer_shapes
from methods.specblock.model import SpecBlockConfig, SpecBlockModel
from specbench.errors import SpecbenchError
from specbench.training.checkpoint import CONFIG, architecture, config_value

OFFICIAL_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
VOCAB_MAPPING = "vocab_mapping.pt"
# Published keys we deliberately drop: the embedding is the target's, frozen; rotary tables are derived.
OFFICIAL_IGNORED = ("input_layer.embed_tokens.*", "*rotary_emb.inv_freq", "*rotary_emb.cos_cached",
                    "*rotary_emb.sin_cached")


def save_specblock(folder: str | Path, model: SpecBlockModel, target, recipe: dict,
                   dtype: torch.dtype | None = torch.bfloat16) -> Path:
    return save_ours(folder, "specblock", model.state_dict(), target, asdict(model.config), model.taps, recipe, dtype,
                     draft_vocab=model.config.draft_vocab_size)


def load_specblock(folder: str | Path, target) -> SpecBlockModel:
    """Our folder format or the published SpecBlock layout (told apart by config.json's "method")."""
    def ours(config: dict, state: dict[str, torch.Tensor]) -> SpecBlockModel:
        arch = architecture(config, SpecBlockConfig, folder)
        taps = check_taps(config_value(config, "taps", folder), target, folder)
        return load_checked(_build(arch, taps, target, folder), state, folder, "SpecBlock")

    return load_ours_or_published(folder, target, "specblock", ours, lambda path, raw: _load_official(path, raw, target))


def _build(arch: SpecBlockConfig, taps, target, folder) -> SpecBlockModel:
    check_layer_shapes(arch, target, folder, "a SpecBlock")
    return SpecBlockModel(arch, tuple(taps), target.model.get_input_embeddings())


def official_config(raw: dict, source: str) -> SpecBlockConfig:
    """The published SpecBlock config: Llama-style shapes plus K and the layer count (eps default 1e-5, as its trainer)."""
    shapes = official_layer_shapes(raw, source, "SpecBlock", eps=1e-5)
    return SpecBlockConfig(**shapes, draft_vocab_size=raw.get("draft_vocab_size") or shapes["vocab_size"],
                           block_size=raw.get("diffspec_draft_token_num", 4), num_layers=raw.get("num_hidden_layers", 2))


def _vocab_mapping(folder: Path) -> dict[str, torch.Tensor] | None:
    path = folder / VOCAB_MAPPING
    if not path.is_file():
        return None
    try:
        mapping = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle and zip errors have many types; all mean the same to the user
        raise SpecbenchError(f"{path} is not a readable vocab mapping ({type(exc).__name__}); re-download it") from None
    if not isinstance(mapping, dict) or not {"t2d", "d2t"} <= set(mapping):
        raise SpecbenchError(f"{path} must hold a dict with 't2d' and 'd2t' tensors")
    return {"t2d": mapping["t2d"].bool(), "d2t": mapping["d2t"].long()}


def _load_official(folder: Path, raw: dict, target) -> SpecBlockModel:
    arch = official_config(raw, str(folder / CONFIG))
    tapped = raw.get("target_hidden_size", arch.hidden_size)
    if tapped != target.hidden_size:
        raise SpecbenchError(f"drafter {folder} fuses taps of hidden size {tapped} but target {target.name!r} has "
                             f"{target.hidden_size}; use a SpecBlock drafter trained for this target")
    state = read_published_weights(folder, OFFICIAL_WEIGHTS, "SpecBlock")
    if "rank_head.0.weight" in state:  # the config does not record the rank head's width
        arch.rank_hidden = state["rank_head.0.weight"].shape[0]
    model = _build(arch, eagle3_taps(target.num_layers), target, folder)
    mapping = _vocab_mapping(folder)
    if mapping is not None:
        state.update(mapping)
    return load_checked(model, state, folder, "SpecBlock", OFFICIAL_IGNORED,
                        hint=f" (no {VOCAB_MAPPING}?)" if "t2d" not in state else "")
