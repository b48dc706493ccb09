"""A PACER pre-verification layer on disk: which draft model it reads, saved and loaded with its checks."""

from __future__ import annotations

import torch

from methods.pacer.model import PreVerifier
from specbench.engine.target import Target
from specbench.errors import SpecbenchError
from specbench.training.checkpoint import check_target, load_drafter, save_drafter, target_fingerprint

METHOD = "pacer"


def draft_fingerprint(draft_model) -> str:
    """Which draft model's hidden states a pre-verification layer reads: a hash of its parameters' names,
    shapes and bf16 values at both ends of each tensor (the same whether the draft is loaded in fp32 or
    bf16, and different for any retrained draft)."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in sorted(draft_model.state_dict().items()):
        flat = p.detach().flatten()
        ends = torch.cat([flat[:512], flat[-512:]]).to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(f"{name}{tuple(p.shape)}".encode())
        digest.update(ends.numpy().tobytes())
    return digest.hexdigest()[:16]


def save_preverifier(folder, model: PreVerifier, target: Target, draft: str, recipe: dict, draft_model,
                     dtype: torch.dtype = torch.float32) -> None:
    config = {"method": METHOD, "target": target_fingerprint(target), "recipe": recipe,
              "architecture": {"window": model.window, "use_pos": model.use_pos, "hidden_size": model.hidden_size,
                               "parameters": model.trainable_parameters()},
              "draft": draft or "shipped SpS draft for the target", "draft_fingerprint": draft_fingerprint(draft_model),
              "note": "PACER blockwise pre-verification layer over the SpS draft model's last hidden states"}
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("body.embed_tokens")}
    save_drafter(folder, state, config, dtype=dtype)


def load_preverifier(folder, target: Target, draft_model, dtype: torch.dtype) -> PreVerifier:
    config, state = load_drafter(folder, target)
    if config.get("method") != METHOD:
        raise SpecbenchError(f"{folder} holds a {config.get('method')!r} drafter, not a PACER pre-verification layer")
    check_target(config, target, folder)
    arch = config["architecture"]
    if arch["hidden_size"] != draft_model.config.hidden_size:
        raise SpecbenchError(f"pre-verification layer {folder} reads hidden size {arch['hidden_size']} but the draft "
                             f"model has {draft_model.config.hidden_size}; train one for this draft with "
                             "`specbench train pacer --draft ...`")
    trained_over = config.get("draft_fingerprint")  # absent in layers saved before it was recorded
    if trained_over and trained_over != draft_fingerprint(draft_model):
        raise SpecbenchError(f"pre-verification layer {folder} was trained over another draft model "
                             f"({config['draft']}; it reads that draft's hidden states); pass that draft with "
                             "--opt draft=... or retrain the layer for this one with `specbench train pacer --draft ...`")
    model = PreVerifier(draft_model.config, arch["window"], arch["use_pos"])
    missing = {k for k in model.state_dict() if not k.startswith("body.embed_tokens")} - set(state)
    if missing:
        raise SpecbenchError(f"pre-verification checkpoint {folder} lacks {sorted(missing)[:3]}; it is incomplete")
    model.load_state_dict(state, strict=False)
    return model.to(dtype=dtype, device=next(draft_model.parameters()).device).eval()
