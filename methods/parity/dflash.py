"""DFlash and DDTree's drafter side against z-lab's own ``dflash`` package (its draft model class and
its generate loop).

Our drafter's weights are written into z-lab's layout in memory: a ``Qwen3Config`` carrying
``dflash_config`` (target layer ids, mask id) and block size, their ``DFlashDraftModel`` built from
it, our state dict loaded into it with every key accounted for (their key names are the published
ones, which ours follow). A layout their class cannot hold is refused in one line.

Our shipped SmolLM2 drafter scores a reduced draft vocabulary (a subset of the target's lm_head
rows); z-lab's loop takes the target's whole lm_head. The loop is handed a view of the target whose
output head scores those rows and leaves the others at -inf, so the argmax picks the same token as
ours; a full-vocabulary drafter (every published one) gets the target itself.

* ``dflash``: z-lab's ``dflash_generate`` loop, timed by its own prefill/decode split (its clock
  synchronizes CUDA; on a CPU the same clock without the synchronize).
* ``ddtree`` (row ``ddtree-drafter``; the DDTree authors' own loop is row ``ddtree``,
  methods/parity/ddtree.py): z-lab's package has no tree loop, so this reference is DDTree's drafter
  side: z-lab's draft model computes the block marginals inside our engine (same heap, same tree
  verify); identical drafts are the check, the speed ratio compares the two drafter forwards.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from methods.ddtree import DDTreeDrafter
from specbench.errors import SpecbenchError
from specbench.run.parity import ReferenceOutput, package_version

INSTALL = "pip install 'specbench[parity]' (or pip install --no-deps dflash)"
DERIVED = ("rotary_emb.inv_freq",)  # buffers their class derives from the config


def _zlab():
    package_version("dflash", INSTALL)
    import dflash.model as zlab

    return zlab


def zlab_config(cfg) -> "object":
    """A Qwen3Config in z-lab's DFlash layout from our ``DFlashConfig``."""
    from transformers import Qwen3Config

    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    config = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
                         max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                         rope_parameters=rope, rope_theta=cfg.rope_theta, attention_bias=False,
                         tie_word_embeddings=False)
    config.block_size = cfg.block_size
    config.num_target_layers = cfg.num_target_layers
    config.dflash_config = {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                            "block_size": cfg.block_size, "input_embedding_scale": cfg.input_embedding_scale,
                            "output_multiplier": cfg.output_multiplier,
                            "final_logit_softcapping": cfg.final_logit_softcapping}
    return config


def zlab_draft_model(ours, name: str, model_class=None, who: str = "z-lab's DFlashDraftModel"):
    """z-lab's ``DFlashDraftModel`` holding our drafter's weights (same dtype and device); ``model_class``
    another class of the same layout and config (DDTree's authors' copy of it), ``who`` names it in errors."""
    if model_class is None:
        model_class = _zlab().DFlashDraftModel
    cfg = ours.config
    model = model_class(zlab_config(cfg))
    state = {k: v for k, v in ours.state_dict().items() if k != "vocab_ids"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(DERIVED)]
    if missing or unexpected:
        raise SpecbenchError(f"{name}: {who} rejects this drafter's layout (it lacks "
                             f"{', '.join(missing[:4]) or 'nothing'}; it has no place for {', '.join(unexpected[:4]) or 'nothing'})")
    if list(model.target_layer_ids) != list(cfg.target_layer_ids) or model.block_size != cfg.block_size:
        raise SpecbenchError(f"{name}: {who} reads different target layers or block size from "
                             "this drafter's config")
    param = next(ours.parameters())
    return model.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)


class DraftVocabularyHead(nn.Module):
    """The target's lm_head restricted to a drafter's draft-vocabulary rows: those rows' logits at their
    target ids, -inf elsewhere (so an argmax over the whole vocabulary picks a draft-vocabulary token)."""

    def __init__(self, weight: torch.Tensor, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.rows = weight.detach()[vocab_ids.to(weight.device)]
        self.vocab_ids, self.vocab = vocab_ids.to(weight.device), weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.rows.to(hidden.dtype))
        full = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)


class TargetView:
    """What z-lab's loop reads of a target (call, device, config, embeddings, ``lm_head``) with another
    output head for the drafter; the target's own forward keeps its own lm_head."""

    def __init__(self, model, head: nn.Module) -> None:
        self.model, self.lm_head = model, head
        self.device, self.config = model.device, model.config

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm_head


def drafter_target(target, ours):
    """The target as z-lab's loop should see it for drafter ``ours``."""
    if not ours.config.draft_vocab_size:
        return target.model
    return TargetView(target.model, DraftVocabularyHead(target.model.get_output_embeddings().weight, ours.vocab_ids))


@contextmanager
def zlab_clock(zlab, device: torch.device):
    """z-lab's loop times prefill and decode with synchronize + perf_counter; a CPU has nothing to
    synchronize (and a CPU build of torch refuses to), so there its clock is perf_counter alone."""
    if device.type == "cuda":
        yield
        return
    original = zlab._cuda_time
    zlab._cuda_time = time.perf_counter
    try:
        yield
    finally:
        zlab._cuda_time = original


class ZLabDFlash:
    name = "dflash"
    reference = "z-lab dflash (DFlashDraftModel + dflash_generate)"
    notes = ("z-lab's dflash_generate loop and DFlashDraftModel class with our drafter's weights written into their "
             "layout; our shipped drafter's reduced draft vocabulary is given to their loop as the target's lm_head "
             "restricted to those rows (-inf elsewhere: same argmax). By design their loop shrinks its block once "
             "fewer than block_size tokens remain in the budget, so the steps there may draft differently (records: "
             "first_accept_difference, tokens_left_there); it uses transformers' DynamicCache with "
             "crop for the drafter's context keys/values where ours concatenates tensors.")

    def version(self) -> str:
        return package_version("dflash", INSTALL)

    def load(self, target, drafter, options) -> None:
        self.zlab = _zlab()
        self.target, self.model = target, zlab_draft_model(drafter.model, drafter.name)
        self.view = drafter_target(target, drafter.model)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=self.target.device).reshape(1, -1)
        with zlab_clock(self.zlab, self.target.device):
            out = self.zlab.dflash_generate(self.model, self.view, ids, max_new_tokens,
                                            sorted(self.target.eos_token_ids), return_stats=True)
        tokens = out.output_ids[0, out.num_input_tokens:].tolist()
        seconds = out.time_per_output_token * out.num_output_tokens
        return ReferenceOutput(tokens, [n - 1 for n in out.acceptance_lengths], seconds)


class ZLabMarginalsDDTree(DDTreeDrafter):
    """DDTree whose block marginals come from z-lab's draft model: their forward over [bonus, MASK...]
    with the committed context's features, their cache of context keys/values (cropped to the committed
    prefix after each block, as their loop does), their logits; our heap and our engine do the rest."""

    def attach_reference(self, zlab, model, head: nn.Module) -> None:
        self.zlab, self.ref_model, self.ref_head = zlab, model, head

    def begin(self, state, prefill) -> None:
        super().begin(state, prefill)
        self.ref_cache = self.zlab._make_cache(self.ref_model.config)

    @torch.inference_mode()
    def block_log_probs(self, state) -> torch.Tensor:
        m, L = self.ref_model, self.ref_model.block_size
        start = len(state.tokens) - 1  # the bonus's position
        context = self.pending[None]
        ids = torch.full((1, L), m.mask_token_id, dtype=torch.long, device=self.target.device)
        ids[0, 0] = state.bonus
        scale = float(self.zlab._draft_value(m.config, "input_embedding_scale", 1.0))
        with state.timer.forward("drafter"):
            noise = self.zlab._raw_input_embeddings(self.target.model, ids, scale)
            positions = torch.arange(start - context.shape[1], start + L, device=ids.device)[None]
            hidden = m(target_hidden=context, noise_embedding=noise, position_ids=positions,
                       past_key_values=self.ref_cache, use_cache=True)[:, 1:, :]
            self.zlab._crop_to(self.ref_cache, start)
            logits = m.compute_logits(hidden, self.ref_head)[0].float()
        self.pending = self.pending[:0]
        return logits.log_softmax(-1)


class ZLabDDTreeDrafterSide:
    name = "ddtree"
    reference = "z-lab dflash (DFlashDraftModel) in our DDTree loop"
    notes = ("drafter side only: z-lab's package has no tree loop (the DDTree authors' own loop is the ddtree row), "
             "so z-lab's DFlashDraftModel with our drafter's weights computes the block marginals inside our engine "
             "(our best-first heap, our tree verify); identical drafts check the drafter forward, and the speed "
             "ratio compares the two drafter forwards and their context caches (theirs a DynamicCache with crop).")

    def version(self) -> str:
        return package_version("dflash", INSTALL)

    def load(self, target, drafter, options) -> None:
        zlab = _zlab()
        model = zlab_draft_model(drafter.model, drafter.name)
        ours = drafter.model
        weight = target.model.get_output_embeddings().weight.detach()
        # the draft-vocabulary rows of the target's lm_head (all of them for a full-vocabulary drafter)
        rows = weight[ours.vocab_ids.to(weight.device)] if ours.config.draft_vocab_size else weight
        head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        head.weight = nn.Parameter(rows, requires_grad=False)
        side = ZLabMarginalsDDTree(options, model=ours)  # our options and weights; only the marginals differ
        side.setup(target)
        side.attach_reference(zlab, model, head)
        self.target, self.side = target, side

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        from specbench.engine.loop import GenerationConfig, generate
        from specbench.run.parity import decode_seconds_of
        from specbench.engine.verify import SamplingParams

        record = generate(self.target, self.side, prompt_ids, GenerationConfig(max_new_tokens, SamplingParams(0.0), 0))
        return ReferenceOutput(record.new_tokens, record.accept_lengths, decode_seconds_of(record))
