"""Shared pieces of the reference-parity tests: the tiny target, the tolerance, the comparison and
its negative-control helper, and the skip when a reference package is not installed."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import torch

from tiny import tiny_target

TOL = 1e-4  # max |Δlogit| in fp32 (issue: parity with the authors' code)
INSTALL = ("pip install -e '.[parity]', or (keeping torch and transformers) pip install --no-deps the extra's "
           "packages as .ci/run does")
# import name -> distribution name
PACKAGES = {"dflash": "dflash", "speculators": "speculators", "medusa": "medusa-llm"}


def require_reference(module: str) -> None:
    """Skip (with the reason) when the reference package is absent or cannot import here."""
    dist = PACKAGES[module]
    try:
        version(dist)
    except PackageNotFoundError:
        pytest.skip(f"reference package {dist!r} is not installed; {INSTALL}")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"reference package {dist!r} is installed but does not import here ({exc})")


def tiny_parity_target(seed: int = 0):
    """A 4-layer random Llama (hidden 32, vocab 64): enough layers for three EAGLE-3 taps."""
    return tiny_target(seed, layers=4)


def target_hidden_states(target, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HF ``hidden_states`` of the target on ids [1, n] (index l = the input of layer l)."""
    with torch.inference_mode():
        return target.model(ids, output_hidden_states=True).hidden_states


def assert_parity(ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    """Same shape, max |Δlogit| <= tol, and the same argmax draft tokens."""
    assert ours.shape == ref.shape, f"shapes differ: ours {tuple(ours.shape)}, reference {tuple(ref.shape)}"
    delta = float((ours.detach().float() - ref.detach().float()).abs().max())
    assert delta <= tol, f"max |Δlogit| = {delta:.3g} > {tol:g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "draft tokens (argmax) differ"


def perturb_saved_weight(folder: Path, key: str, file: str = "model.safetensors") -> None:
    """Add 0.5 to one element of one tensor in a saved checkpoint (the negative control)."""
    path = Path(folder) / file
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file, save_file

        state = load_file(path)
        state[key] = state[key].clone()
        state[key].view(-1)[0] += 0.5
        save_file(state, path, metadata={"format": "pt"})
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state[key] = state[key].clone()
        state[key].view(-1)[0] += 0.5
        torch.save(state, path)


def save_tiny_tokenizer(folder: Path, vocab: int = 64) -> Path:
    """A word-level tokenizer of ``vocab`` tokens (t0..t{vocab-1}) saved as HF files: for reference
    code that loads its target's tokenizer by path (medusa-llm's MedusaModel)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    raw = Tokenizer(WordLevel(words, unk_token="t0"))
    raw.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", eos_token=f"t{vocab - 1}").save_pretrained(folder)
    return Path(folder)
