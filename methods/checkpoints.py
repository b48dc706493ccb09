"""Drafter checkpoints in either layout: our folder (``specbench.training.checkpoint``: config.json
naming the method, architecture and target) or a method's published layout (config.json without
"method", weights under the publisher's file names), and the one-line key checks both share."""

from __future__ import annotations

import json
import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch

from specbench.errors import SpecbenchError
from specbench.training.checkpoint import (load_drafter, load_state_exactly, read_drafter_config, read_weights,
                                           save_drafter, target_fingerprint)

Model = TypeVar("Model", bound=torch.nn.Module)
KEY_WORDS = ("lacks keys:", "has keys this loader does not map:")  # what check_keys says of missing / extra keys
SHOWN_KEYS = 8  # key names listed in one error line
PACKAGED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


def shipped_drafter(target_name: str, name: str) -> Path:
    """The default folder of drafter ``name`` for a target: ``<root>/<target>/<name>``, where root is
    ``$SPECBENCH_DRAFTERS`` when set (drafters trained elsewhere, e.g. a retraining run, replace the
    checkout's whole set) and the checkout's ``drafters/`` otherwise."""
    root = os.environ.get("SPECBENCH_DRAFTERS")
    return (Path(root).expanduser() if root else PACKAGED_DRAFTERS) / Path(target_name).name / name


def load_ours_or_published(folder: str | Path, target, method: str, ours: Callable[[dict, dict], Model],
                           published: Callable[[Path, dict], Model]) -> Model:
    """``ours(config, state)`` for our folder, whose config.json names ``method`` (weights read and
    the target checked by ``load_drafter``), else ``published(folder, raw config)``."""
    raw = read_drafter_config(folder)
    if "method" not in raw:
        return published(Path(folder), raw)
    if raw["method"] != method:
        raise SpecbenchError(f"{folder} holds a {raw['method']!r} drafter, not {method}")
    config, state = load_drafter(folder, target)
    return ours(config, state)


def read_published_weights(folder: str | Path, candidates: tuple[str, ...], kind: str) -> dict[str, torch.Tensor]:
    """The first of ``candidates`` found in ``folder``, whole or sharded: HF writes a large checkpoint as
    shards listed by ``<name>.index.json`` (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``)
    instead of ``<name>``. A missing or garbled shard is one line."""
    folder = Path(folder)
    for name in candidates:
        if (folder / name).is_file():
            return read_weights(folder, (name,), kind)
        index = folder / f"{name}.index.json"
        if index.is_file():
            return _read_shards(index, kind)
    return read_weights(folder, candidates, kind)  # none found: its one-line error names what the folder holds


def _read_shards(index: Path, kind: str) -> dict[str, torch.Tensor]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise SpecbenchError(f"{index} is not a shard index (no weight_map of key -> file); re-download the "
                             f"{kind} checkpoint") from None
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise SpecbenchError(f"{index} names shard(s) {', '.join(missing[:3])} that {index.parent} lacks; re-download "
                             f"the {kind} checkpoint")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(read_weights(index.parent, (shard,), kind))
    lost = [k for k in weight_map if k not in state]
    if lost:
        raise SpecbenchError(f"{index} maps keys its shards lack: {key_names(lost)}; re-download the {kind} checkpoint")
    return state


def save_ours(folder: str | Path, method: str, state: dict[str, torch.Tensor], target, architecture: dict,
              taps: Sequence[int], recipe: dict, dtype: torch.dtype | None, **extra) -> Path:
    """Our folder: config.json with the method, architecture, target fingerprint, taps, recipe and
    ``extra`` keys; ``dtype`` None keeps the tensors' dtype."""
    config = {"method": method, "architecture": architecture, "target": target_fingerprint(target),
              "taps": list(taps), "recipe": recipe, **extra}
    return save_drafter(folder, state, config, dtype)


def key_names(keys: Sequence[str]) -> str:
    listed = sorted(keys)
    more = len(listed) - SHOWN_KEYS
    return ", ".join(listed[:SHOWN_KEYS]) + (f" (+{more} more)" if more > 0 else "")


def check_keys(found: Sequence[str], expected: Sequence[str], folder: str | Path, kind: str,
               ignored: Sequence[str] = (), hint: str = "", words: tuple[str, str] = KEY_WORDS) -> None:
    """Every expected key present and every other found key one matching an ``ignored`` glob, else
    one line naming the keys (``hint`` follows the missing ones; ``words`` say missing / extra)."""
    found, expected = set(found), set(expected)
    extra = [k for k in found - expected if not any(fnmatchcase(k, pattern) for pattern in ignored)]
    if extra:
        raise SpecbenchError(f"{kind} checkpoint {folder} {words[1]} {key_names(extra)}")
    missing = expected - found
    if missing:
        raise SpecbenchError(f"{kind} checkpoint {folder} {words[0]} {key_names(missing)}{hint}")


def load_checked(model: Model, state: dict[str, torch.Tensor], folder: str | Path, kind: str,
                 ignored: Sequence[str] = (), hint: str = "", words: tuple[str, str] = KEY_WORDS) -> Model:
    """``check_keys`` against ``model``'s state dict, then load exactly (in the checkpoint's dtype);
    keys matching ``ignored`` are dropped unless the model has them."""
    expected = model.state_dict()
    check_keys(state, expected, folder, kind, ignored, hint, words)
    state = {k: v for k, v in state.items() if k in expected}
    return load_state_exactly(model, state, folder, f"{kind} checkpoint")


def check_layer_shapes(arch, target, folder: str | Path, kind: str) -> None:
    """A drafter built on the target's hidden states and vocabulary must match both (an EAGLE-3
    drafter with ``target_hidden_size`` reads taps of that size through its own width); ``kind``
    reads "a SpecBlock", "an EAGLE-3", ..."""
    tapped = getattr(arch, "target_hidden_size", 0) or arch.hidden_size
    if tapped != target.hidden_size:
        raise SpecbenchError(f"drafter {folder} has hidden size {tapped} but target {target.name!r} has "
                             f"{target.hidden_size}; use {kind} drafter trained for this target")
    if arch.vocab_size != target.vocab_size:
        raise SpecbenchError(f"drafter {folder} maps a vocabulary of {arch.vocab_size} tokens but target "
                             f"{target.name!r} has {target.vocab_size}; use a drafter trained for this target")
