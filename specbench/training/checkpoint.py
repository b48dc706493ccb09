"""Drafter checkpoints as Hugging Face-style folders: ``config.json`` + ``model.safetensors``.

``config.json`` records the architecture, the target it was trained for (a fingerprint of the
tokenizer and the hidden size), the target taps, the draft-vocabulary mapping and the training
recipe. Loading refuses a drafter trained for another target, in one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specbench.errors import SpecbenchError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary and special tokens, as drafters written before ``vocab`` recorded it."""
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = [getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id")]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


def vocab_fingerprint(tokenizer) -> str:
    """Hash of the token -> id mapping: what makes token ids mean the same. Special-token metadata is
    left out on purpose: transformers releases disagree on it for one GGUF file (5.17 reads SmolLM2's
    eos as 1 and no pad, 5.23 eos 2 and pad 2) while every id means the same token."""
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def target_fingerprint(target) -> dict:
    return {"name": target.name, "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "vocab": vocab_fingerprint(target.tokenizer), "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size, "num_layers": target.num_layers}


def save_drafter(folder: str | Path, state_dict: dict[str, torch.Tensor], config: dict,
                 dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (floating tensors cast to ``dtype``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in state_dict.items()}
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def read_drafter_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise SpecbenchError(f"{folder} is not a drafter folder (no {CONFIG}); train one with `specbench train` "
                             "or pass the right path")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SpecbenchError(f"{path} is corrupt ({exc.msg} at line {exc.lineno}); retrain or re-download it") from None
    except (UnicodeDecodeError, RecursionError):
        raise SpecbenchError(f"{path} is corrupt (not UTF-8 JSON, or nested past reading); retrain or re-download it") \
            from None
    from specbench.schemas import check_tree

    check_tree(raw, path, None, "retrain or re-download the drafter")  # lone surrogates, absurd nesting
    if not isinstance(raw, dict):
        raise SpecbenchError(f"{path} is corrupt (a {type(raw).__name__}, not a mapping); retrain or re-download it")
    return raw


def config_value(config: dict, key: str, folder: str | Path):
    """``config[key]``, or one line naming the damaged config.json."""
    if not isinstance(config, dict) or key not in config:
        raise SpecbenchError(f"{Path(folder) / CONFIG} lacks {key!r}; the drafter folder is damaged or incomplete: "
                             "retrain or re-download it")
    return config[key]


def architecture(config: dict, cls, folder: str | Path):
    """``cls(**config["architecture"])``; missing or unknown fields are one line naming config.json."""
    fields = config_value(config, "architecture", folder)
    try:
        return cls(**fields)
    except TypeError as exc:
        raise SpecbenchError(f"{Path(folder) / CONFIG} has an architecture this version cannot build ({exc}); "
                             "retrain or re-download the drafter") from None


def load_drafter(folder: str | Path, target=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state_dict); with ``target`` given, refuse a drafter trained for another one."""
    config = read_drafter_config(folder)
    weights = Path(folder) / WEIGHTS
    if not weights.is_file():
        raise SpecbenchError(f"{folder} has no {WEIGHTS}; the checkpoint is incomplete")
    try:
        state = load_file(str(weights))
    except Exception as exc:  # safetensors raises several types for truncated or garbled files
        raise SpecbenchError(f"{weights} is corrupt ({type(exc).__name__}); retrain or re-download it") from None
    if target is not None:
        check_target(config, target, folder)
    return config, state


def check_target(config: dict, target, folder: str | Path) -> None:
    trained = config.get("target", {})
    ours = target_fingerprint(target)
    # ``vocab`` supersedes ``tokenizer`` (which also hashed special-token metadata) where recorded.
    keys = ("vocab", "hidden_size") if "vocab" in trained else ("tokenizer", "hidden_size")
    for key in keys:
        if key in trained and trained[key] != ours[key]:
            raise SpecbenchError(f"drafter {folder} was trained for target {trained.get('name', '?')!r} "
                                 f"({key} differs from {target.name!r}); train one for this target with `specbench train`")


def found_layout(folder: str | Path) -> str:
    """What a drafter folder holds, for 'matches no layout we know' errors: its files and the
    config keys that name a format (architectures, model_type)."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")) \
        if folder.is_dir() else []
    shown = ", ".join(files[:8]) + (f" (+{len(files) - 8} more)" if len(files) > 8 else "") if files else "no files"
    try:
        raw = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}
    named = [f"{k}={raw[k]}" for k in ("architectures", "model_type") if isinstance(raw, dict) and raw.get(k)]
    return f"found {shown}" + (f" ({CONFIG}: {', '.join(named)})" if named else "")


def read_weights(folder: str | Path, candidates: tuple[str, ...], kind: str) -> dict[str, torch.Tensor]:
    """The first of ``candidates`` (.safetensors or a torch pickle, loaded weights-only) in ``folder``;
    used by the loaders of published checkpoint formats."""
    for name in candidates:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # both loaders raise several types for truncated or garbled files
            raise SpecbenchError(f"{path} is corrupt ({type(exc).__name__}); re-download it") from None
    raise SpecbenchError(f"{folder} has none of {', '.join(candidates)}; it is not a complete {kind} checkpoint "
                         f"({found_layout(folder)})")


def load_state_exactly(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: str | Path,
                       what: str = "drafter") -> torch.nn.Module:
    """Cast ``model`` to the checkpoint's floating dtype (so loading is exact), then load; a shape
    or key mismatch becomes one line naming the folder."""
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    if dtype is not None:
        model.to(dtype)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        last = str(exc).strip().splitlines()[-1].strip()
        raise SpecbenchError(f"{what} {folder} does not match its config ({last})") from None
    return model
