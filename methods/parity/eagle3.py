"""EAGLE-3 against SafeAILab/EAGLE's own decode loop: ``EaModel.eagenerate`` (eagle/model/ea_model.py) with
their ``KVLlamaForCausalLM`` (eagle/model/modeling_llama_kv.py) holding the target and their EAGLE-3 draft
``Model`` (eagle/model/cnets.py) holding our drafter's weights. Their code is published on GitHub only, so it
is imported at run time from a snapshot (``--reference-src`` or ``$SPECBENCH_REF_EAGLE``), never copied.

Our EAGLE-3 module names follow the official key names, so our state dict loads into their ``Model`` key for
key (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; their ``embed_tokens`` gets the target's
embedding, or the drafter's own); their config reads ``draft_vocab_size`` and ``target_hidden_size``. Their Llama
taps the inputs of layers 2, L/2 and L-3 (hard-coded), which are ours (``eagle3_taps``). Both sides grow the
same tree: their ``total_token``, ``depth`` and ``top_k`` are our ``total_tokens`` (verify rows, the root
included), ``depth`` and ``top_k`` (a parity run gives both sides ``OPTIONS``, their own defaults).

Their loop runs unchanged. What the adapter reads of it, through one wrapper around their draft model's
``topK_genrate`` (``DraftLog``), which every step calls with the whole sequence so far plus the next root:
the new tokens, the per-step accept lengths (the growth of that sequence, less the bonus) and the clock.
The prefill (their target forward over the prompt, and its first token) is not timed: decode time runs from
the start of their first draft to the start of the draft their loop makes after the verify step where ours
stops (that last tree is never verified; ours drafts none after its last step). Their budget test
(``new_token > max_new_tokens``, ``new_token`` not counting the pending bonus) stops one step past the budget;
given the budget less 2 it stops after the same step as ours.

Shims for transformers 5, applied at run time, their files untouched: ``qwen_stubs`` (their Qwen modules, which
no longer import and a Llama target never runs), ``eagle_llama_config`` and ``eagle_draft_config`` (the 4.x RoPE
config fields their Llama and their draft model read, ``with_4x_rope_fields``). ``EaModel`` is constructed
directly (not ``from_pretrained``, which loads from the hub or a folder) with the target's tokenizer saved to a
temporary folder (it loads one by path, for its EOS id) and its cache allocated once in ``load``.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch

from specbench.engine.timing import synchronize
from specbench.errors import SpecbenchError
from specbench.run.parity import ReferenceOutput
from specbench.run.snapshots import Repository, import_snapshot, locate_snapshot

REPOSITORY = Repository(url="https://github.com/SafeAILab/EAGLE", licence="Apache-2.0", env="SPECBENCH_REF_EAGLE",
                        marker="eagle/model/ea_model.py")
# EaModel.from_pretrained's defaults, which are ours too: both sides build this tree unless --opt says otherwise.
OPTIONS = {"total_tokens": 60, "depth": 7, "top_k": 10}
DERIVED = ("rotary_emb.inv_freq",)  # their rotary buffers, derived from the config


def qwen_stubs() -> dict[str, ModuleType]:
    """Shim: ``ea_model`` imports their Qwen2 and Qwen3 KV models at import time, and those modules import
    names transformers 5 removed (``transformers.modeling_attn_mask_utils``, ``transformers.utils.LossKwargs``).
    A Llama target never runs them: stand-ins that hold only the class names ``ea_model`` imports."""
    stubs = {}
    for name, cls in (("modeling_qwen2_kv", "Qwen2ForCausalLM"), ("modeling_qwen3_kv", "Qwen3ForCausalLM")):
        module = ModuleType(f"eagle.model.{name}")
        setattr(module, cls, type(cls, (), {"__doc__": "not importable under transformers 5; never run here"}))
        stubs[module.__name__] = module
    return stubs


def with_4x_rope_fields(config, theta: float):
    """``config`` (modified and returned) with the RoPE fields transformers 4 configs had and their 4.x code reads:
    ``rope_scaling`` None for plain RoPE (transformers 5 answers ``rope_scaling`` with the standardized
    ``rope_parameters``, a dict without the "type" their rotary setup looks up), ``rope_theta`` (now inside
    ``rope_parameters``) and ``pretraining_tp`` 1."""
    config.rope_parameters = None  # what transformers 5 returns for config.rope_scaling
    config.rope_theta = float(theta)
    config.pretraining_tp = 1
    return config


def eagle_llama_config(config, theta: float):
    """Shim: their ``modeling_llama_kv`` is transformers 4.31's Llama and reads the 4.x RoPE fields
    (``with_4x_rope_fields``). Their class lists its tied weights the 4.x way, so it is built untied (the
    lm_head is loaded from the target's), with eager attention (their attention is their own code)."""
    config = with_4x_rope_fields(copy.deepcopy(config), theta)
    config.tie_word_embeddings = False
    config._attn_implementation = "eager"
    return config


@contextmanager
def eagle_draft_config(ea_model: ModuleType):
    """Shim: ``EaModel.__init__`` reads its draft model's config file with their ``EConfig`` (a transformers
    config), and their ``cnets`` rotary setup then reads the 4.x RoPE fields: while their constructor runs,
    ``EConfig.from_pretrained`` is theirs followed by ``with_4x_rope_fields`` (theta from the file)."""
    original = ea_model.EConfig

    class EConfigWith4xRope:
        @staticmethod
        def from_pretrained(path):
            from methods.layers import rope_of

            with warnings.catch_warnings():  # their EConfig assigns rope_scaling, which transformers 5 deprecates
                warnings.simplefilter("ignore", FutureWarning)
                config = original.from_pretrained(path)
            return with_4x_rope_fields(config, rope_of(config)[0])

    ea_model.EConfig = EConfigWith4xRope
    try:
        yield
    finally:
        ea_model.EConfig = original


class DraftLog:
    """Wraps their draft model's ``topK_genrate`` for one generation: keeps, per call, the sequence it was
    given (prompt, tokens so far and the next root: their loop appends the accepted tokens, then drafts from
    the bonus) and the call's start on the clock (synchronized on CUDA). Call 0 is the prompt's first draft;
    call k follows verify step k."""

    def __init__(self, layer, device: torch.device) -> None:
        self.layer, self.device = layer, device
        self.sequences: list[torch.Tensor] = []
        self.starts: list[int] = []

    def __enter__(self) -> "DraftLog":
        original = self.layer.topK_genrate

        def logged(hidden_states, input_ids, head, logits_processor):
            synchronize(self.device)
            self.starts.append(time.perf_counter_ns())
            self.sequences.append(input_ids)  # a fresh tensor each call (their torch.cat); read after the loop
            return original(hidden_states, input_ids, head, logits_processor)

        self.layer.topK_genrate = logged  # an instance attribute over their method, removed on exit
        return self

    def __exit__(self, *exc) -> None:
        del self.layer.topK_genrate


def _cut(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:limit]


class EagleEaGenerate:
    name = "eagle3"
    repository = REPOSITORY
    source: str | None = None
    reference = f"SafeAILab/EAGLE EaModel.eagenerate ({REPOSITORY.url})"
    options = dict(OPTIONS)
    notes = ""

    def version(self) -> str:
        self.snapshot = locate_snapshot(self.repository, self.source)
        self.reference = f"SafeAILab/EAGLE EaModel.eagenerate, {self.snapshot.describe()}"
        self.notes = (
            f"{self.repository.url} at commit {self.snapshot.commit[:12]} ({self.repository.licence}), imported at "
            "run time from a checkout: their EaModel.eagenerate loop unchanged, greedy, on their KVLlamaForCausalLM "
            "holding the target's weights (their hard-coded taps, inputs of layers 2, L/2, L-3, are ours) and their "
            "EAGLE-3 draft Model (cnets.py) holding our drafter key for key (fc, midlayer, norm, lm_head, d2t, t2d; "
            "the target's embedding as theirs); both sides grow the same tree (their total_token/depth/top_k = our "
            "total_tokens/depth/top_k, 60/7/10 unless --opt says otherwise). Shims for transformers 5, their files "
            "untouched: their Qwen2/Qwen3 KV modules, which import names transformers 5 removed and a Llama target "
            "never runs, are stubbed at import; their Llama's config (a copy of the target's) and their EConfig get "
            "the 4.x fields their code reads (rope_scaling None, rope_theta, pretraining_tp 1); their Llama is built "
            "untied with eager attention and loads the target's state dict; EaModel is constructed directly (not "
            "from_pretrained) from a config.json with draft_vocab_size and target_hidden_size, our state dict and the "
            "target's tokenizer saved to a temporary folder. Their KV cache is allocated once at load (the target's "
            "context) and reset per prompt by their loop. Read from their loop through a wrapper on topK_genrate, "
            "which every step calls with the sequence so far and the next root: tokens, per-step accept lengths and "
            "the clock. Their clock runs from the start of their first draft (after the prefill forward and its "
            "first token, as ours) to the start of the draft their loop makes after the verify step where ours "
            "stops: that last tree, never verified, is not counted (ours drafts none after its last step), nor is "
            "an extra step after an EOS bonus (their loop tests EOS, their tokenizer's one id, only in the tokens "
            "before the pending bonus). Their budget test (new_token > max_new_tokens, not counting the pending "
            "bonus) overshoots by one step, so it is given the budget less 2 and stops after the same step as ours. "
            "By design and counted: their target's eager attention with a 4-D float mask over a preallocated cache "
            "into which the accepted rows are copied; their drafter's eager attention and concatenated keys/values; "
            "the tree mask and retrieve indices built with host copies and Python loops every step; their per-step "
            "EOS scan of all new tokens on the host.")
        return self.snapshot.commit[:12]

    # ---- load -------------------------------------------------------------------------------
    def load(self, target, drafter, options) -> None:
        snapshot = getattr(self, "snapshot", None) or locate_snapshot(self.repository, self.source)
        self.snapshot = snapshot
        mods = import_snapshot(snapshot, ["eagle.model.ea_model", "eagle.model.modeling_llama_kv",
                                          "eagle.model.kv_cache"], tops=("eagle",), stubs=qwen_stubs())
        ours = getattr(drafter, "model", None)
        if ours is None or not hasattr(ours, "d2t"):
            raise SpecbenchError(f"{drafter.name}: their EaModel needs an EAGLE-3 drafter; this drafter holds none")
        cfg = ours.config
        if cfg.fc_norm or not cfg.norm_output:
            raise SpecbenchError("eagle3: their EAGLE-3 Model has no per-tap norm before fc and always norms before "
                                 "lm_head; this drafter (SpecForge layout) cannot be expressed in it")
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise SpecbenchError(f"eagle3: their draft attention uses head_dim = hidden_size / heads; this drafter has "
                                 f"head_dim {cfg.head_dim}")
        if target.tokenizer is None:
            raise SpecbenchError(f"eagle3: their EaModel loads the target's tokenizer by path (its EOS id); target "
                                 f"{target.name!r} has none")
        tconf = target.model.config
        if getattr(tconf, "model_type", "") != "llama":
            raise SpecbenchError(f"eagle3: this reference runs their Llama KV model; target {target.name!r} is "
                                 f"{getattr(tconf, 'model_type', '?')!r}")
        from methods.layers import rope_of
        from methods.taps import eagle3_taps

        theta, scaling = rope_of(tconf)
        if scaling is not None or cfg.rope_scaling:
            raise SpecbenchError(f"eagle3: RoPE scaling ({scaling or cfg.rope_scaling}) is not mapped onto their "
                                 "4.x rotary classes here")
        heads = tconf.num_attention_heads
        if (getattr(tconf, "head_dim", None) or tconf.hidden_size // heads) * heads != tconf.hidden_size:
            raise SpecbenchError(f"eagle3: their Llama uses head_dim = hidden_size / heads; target {target.name!r} "
                                 "has another head_dim")
        hard_coded = eagle3_taps(target.num_layers)  # their LlamaModel appends the inputs of layers 2, L/2, L-3
        if tuple(ours.taps) != hard_coded or len(set(hard_coded)) != 3:
            raise SpecbenchError(f"eagle3: their Llama taps the inputs of layers 2, L/2 and L-3 ({list(hard_coded)} "
                                 f"here, three distinct needed); this drafter reads {list(ours.taps)}")
        k = options.top_k
        if k > cfg.draft_vocab_size or options.total_tokens - 1 > k + options.depth * k * k:
            raise SpecbenchError(f"eagle3: their tree takes the best total_tokens - 1 of top_k + depth x top_k^2 "
                                 f"candidates, top_k <= the draft vocabulary ({cfg.draft_vocab_size}); got top_k {k}, "
                                 f"depth {options.depth}, total_tokens {options.total_tokens}")

        # Their Llama holding the target.
        llama = mods["eagle.model.modeling_llama_kv"].LlamaForCausalLM(eagle_llama_config(tconf, theta))
        state = dict(target.model.state_dict())
        state["lm_head.weight"] = target.model.get_output_embeddings().weight
        missing, unexpected = llama.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith(DERIVED)]
        if missing or unexpected:
            raise SpecbenchError(f"eagle3: their Llama does not take the target's weights (lacks {missing[:3]}, "
                                 f"no place for {unexpected[:3]})")
        llama = llama.to(device=target.device, dtype=target.dtype).eval()

        # Their draft Model holding ours: a config.json (EConfig) and our state dict.
        self._folder = tempfile.TemporaryDirectory()
        folder = Path(self._folder.name)
        target.tokenizer.save_pretrained(folder)  # EaModel loads the tokenizer by path (its EOS id)
        econfig = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bias": False,
                   "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
                   "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.tap_size,
                   "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
                   "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                   "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
                   "max_position_embeddings": cfg.max_position_embeddings, "pretraining_tp": 1,
                   "tie_word_embeddings": False}
        (folder / "ea_config.json").write_text(json.dumps(econfig), encoding="utf-8")
        weights = {k: v for k, v in ours.state_dict().items()}
        own = getattr(ours, "embed_tokens", None)
        weights["embed_tokens.weight"] = (own if own is not None else target.model.get_input_embeddings()).weight
        full = cfg.draft_vocab_size == cfg.vocab_size
        if full:  # their constructor deletes d2t/t2d for a full-vocabulary drafter
            weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
        ea = mods["eagle.model.ea_model"]
        with eagle_draft_config(ea):
            model = ea.EaModel(True, llama, str(folder), str(folder / "ea_config.json"), options.total_tokens,
                               options.depth, options.top_k, 1.0, weights)
        theirs = model.ea_layer.state_dict()
        lacking = sorted(set(theirs) - set(weights))
        extra = sorted(set(weights) - set(theirs))
        if lacking or extra:
            raise SpecbenchError(f"eagle3: their EAGLE-3 Model does not take this drafter key for key (lacks "
                                 f"{lacking[:3]}, no place for {extra[:3]})")
        loaded = {k for k, v in weights.items() if not torch.equal(theirs[k].to(v.device, v.dtype), v)}
        if loaded:
            raise SpecbenchError(f"eagle3: their EAGLE-3 Model read {sorted(loaded)[:3]} otherwise than written")
        if model.ea_layer.fc.in_features != len(ours.taps) * cfg.tap_size:
            raise SpecbenchError("eagle3: their fc reads another tap width than this drafter's")
        bases = {float(model.ea_layer.midlayer.self_attn.rotary_emb.base)}
        bases |= {float(layer.self_attn.rotary_emb.base) for layer in llama.model.layers}
        if bases != {float(cfg.rope_theta)} or float(theta) != float(cfg.rope_theta):
            raise SpecbenchError(f"eagle3: their rotary modules read RoPE base {sorted(bases)}; target and drafter "
                                 f"use {theta} and {cfg.rope_theta}")
        model.eval()
        # Their cache, allocated once here (their loop allocates it on its first call and resets it on later ones).
        self.max_length = target.max_context
        model.past_key_values, model.past_key_values_data, model.current_length_data = \
            mods["eagle.model.kv_cache"].initialize_past_key_values(model.base_model, max_length=self.max_length)
        self.model, self.target = model, target
        self.eos = set(target.eos_token_ids)

    # ---- one generation ---------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        device = self.target.device
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device).reshape(1, -1)
        n = ids.shape[1]
        with DraftLog(self.model.ea_layer, device) as log:
            # new_token counts what is appended before the pending bonus and must exceed the budget it is given
            self.model.eagenerate(ids, temperature=0.0, max_new_tokens=max_new_tokens - 2, max_length=self.max_length)
        sequences = [s[0, n:].tolist() for s in log.sequences]
        stop = len(sequences) - 1  # our engine stops after the first step whose tokens reach the budget or an EOS
        for i, seq in enumerate(sequences):
            if len(seq) >= max_new_tokens or self.eos.intersection(seq):
                stop = i
                break
        accept = [len(sequences[i]) - len(sequences[i - 1]) - 1 for i in range(1, stop + 1)]
        seconds = (log.starts[stop] - log.starts[0]) / 1e9
        return ReferenceOutput(_cut(sequences[stop], self.eos, max_new_tokens), accept, seconds)
