"""Medusa against FasterDecoding's own package, medusa-llm (``MedusaModel.medusa_generate``).

Our loaded heads are written into medusa-llm's layout (its ``medusa_head``: per head one ResBlock and
an output Linear, here the target's lm_head when our heads share it) and its generate loop runs
unchanged, greedy (its typical acceptance is off at temperature 0: exact argmax matching).

medusa-llm 0.1 (the PyPI release) predates today's Llama checkpoints, so its own Llama class gets
an equivalent model of the target, built with its own modules:
* its KV cache holds ``num_attention_heads`` key/value heads, so a GQA target (SmolLM2-135M: 9 query,
  3 key/value heads) becomes the same function with each key/value head repeated for its group;
* its rotary module is built with base 10000 whatever the config says, so each layer's is rebuilt
  with its own class and the target's ``rope_theta``; RoPE scaling of other kinds is refused;
* it reads ``config.rope_scaling['type']``, which transformers 5 configs no longer carry, and lists its
  tied weights the transformers-4 way (so the lm_head is loaded untied, from the target's).
Its trees are dense (top-k_d of head d, every combination: ``medusa_choices=[1, k_1, ..., k_d]``),
so our drafter must run the same dense tree: a parity run gives both sides ``DENSE_TOPK``'s tree unless
``--opt choices=<the rank paths>`` names another dense one (see ``dense_topk``).
Per-step accept lengths and the new tokens are read from the values its loop passes between its
own functions (``evaluate_posterior``, ``update_inference_inputs``), not recomputed.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from specbench.errors import SpecbenchError
from specbench.run.parity import ReferenceOutput, package_version
from specbench.engine.timing import synchronize


def dense_topk(paths: Sequence[Sequence[int]]) -> list[int] | None:
    """[k_1..k_d] when ``paths`` are exactly medusa-llm's dense tree (every (i_1..i_e), e <= d, i_j < k_j),
    else None."""
    paths = {tuple(p) for p in paths}
    if not paths:
        return None
    depth = max(map(len, paths))
    topk = [1 + max(p[d] for p in paths if len(p) > d) for d in range(depth)]
    want, level = set(), [()]
    for k in topk:
        level = [p + (i,) for p in level for i in range(k)]
        want.update(level)
    return topk if want == paths else None


def dense_choices_json(topk: Sequence[int]) -> str:
    paths, level = [], [[]]
    for k in topk:
        level = [p + [i] for p in level for i in range(k)]
        paths += level
    return str(paths).replace(" ", "")


def expand_gqa(state: dict[str, torch.Tensor], heads: int, kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """k_proj/v_proj rows repeated per query group: the same attention with one key/value head per query head."""
    if heads == kv_heads:
        return state
    groups = heads // kv_heads
    out = dict(state)
    for key, w in state.items():
        if key.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            out[key] = w.view(kv_heads, head_dim, -1).repeat_interleave(groups, 0).reshape(heads * head_dim, -1)
    return out


# The tree a parity run uses by default: our default (mc_sim_7b_63) is sparse, which medusa-llm cannot
# run; top-4 of head 1 and top-2 of heads 2 and 3 is 28 nodes, near the size of Medusa's own sparse trees.
DENSE_TOPK = (4, 2, 2)


class MedusaLLM:
    name = "medusa"
    reference = "medusa-llm medusa_generate"
    notes = ("FasterDecoding's medusa-llm 0.1 (PyPI) runs its own generate loop, greedy, on its own Llama class "
             "holding the same target: GQA key/value heads repeated per query group (its KV cache has one per "
             "query head), its rotary modules rebuilt with the target's rope_theta (it hard-codes 10000), eager "
             "attention (its class predates SDPA). Its trees are dense (top-k per head, every combination), so "
             "ours runs the same dense tree. By design it attends over full-size (repeated) keys/values, "
             "allocates a KV cache for the whole context window, decodes the text on every step and tests EOS in "
             "all new tokens every step.")

    options = {"choices": dense_choices_json(DENSE_TOPK)}  # both sides, unless --opt choices= is given

    def version(self) -> str:
        return package_version("medusa-llm")

    def load(self, target, drafter, options) -> None:
        try:
            from medusa.model.medusa_model import MedusaModel
            from medusa.model.modeling_llama_kv import LlamaForCausalLM, LlamaRotaryEmbedding
        except ImportError as exc:
            raise SpecbenchError(f"medusa-llm is installed but does not import here ({exc}); reinstall it") from None
        heads = getattr(drafter, "heads", None)
        skeleton = getattr(drafter, "skeleton", None)
        if heads is None or skeleton is None:
            raise SpecbenchError(f"{drafter.name}: medusa-llm needs Medusa heads; this drafter holds none")
        topk = dense_topk(skeleton.paths)
        if topk is None:
            raise SpecbenchError("medusa: medusa-llm 0.1 runs dense trees only (top-k of each head, every "
                                 "combination); pass e.g. --opt choices=" + dense_choices_json(DENSE_TOPK))
        if heads.num_layers != 1:
            raise SpecbenchError(f"medusa: medusa-llm stacks one shared ResBlock per head ([ResBlock] * layers); "
                                 f"these heads have {heads.num_layers} distinct ones")
        config = copy.deepcopy(target.model.config)
        if getattr(config, "model_type", "") != "llama":
            raise SpecbenchError(f"medusa: medusa-llm runs Llama targets only; {target.name!r} is "
                                 f"{getattr(config, 'model_type', '?')!r}")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise SpecbenchError(f"medusa: medusa-llm's rotary modules know no {rope['rope_type']!r} RoPE scaling, "
                                 f"which target {target.name!r} uses")
        theta = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
        heads_n, kv_n = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        head_dim = config.hidden_size // heads_n
        config.num_key_value_heads = heads_n
        config.rope_scaling = None
        config.max_position_embeddings = target.max_context
        config._attn_implementation = "eager"
        config.tie_word_embeddings = False  # its class lists tied keys the transformers-4 way; lm_head is loaded below
        base = LlamaForCausalLM(config)
        state = expand_gqa(target.model.state_dict(), heads_n, kv_n, head_dim)
        state["lm_head.weight"] = target.model.get_output_embeddings().weight
        missing, unexpected = base.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
        if missing:
            raise SpecbenchError(f"medusa: medusa-llm's Llama lacks nothing of the target but got no {missing[:3]}")
        for layer in base.model.layers:
            layer.self_attn.rotary_emb = LlamaRotaryEmbedding(head_dim, config.max_position_embeddings, base=theta)
        base = base.to(device=target.device, dtype=target.dtype).eval()
        self._tokenizer_dir = tempfile.TemporaryDirectory()
        target.tokenizer.save_pretrained(self._tokenizer_dir.name)  # MedusaModel loads its tokenizer by path
        model = MedusaModel(base, medusa_num_heads=len(topk), medusa_num_layers=1,
                            base_model_name_or_path=self._tokenizer_dir.name)
        with torch.no_grad():
            for k, head in enumerate(model.medusa_head):
                head[0].linear.weight.copy_(heads.res_weight[k, 0])
                head[0].linear.bias.copy_(heads.res_bias[k, 0])
                head[1].weight.copy_(heads._output_weight() if heads.shared_lm_head else heads.lm_weight[k])
        self.model, self.target, self.topk = model.eval(), target, topk
        self.eos = set(target.eos_token_ids)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        import medusa.model.medusa_model as loop

        device = self.target.device
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device).reshape(1, -1)
        n = ids.shape[1]
        seen = {"accept": [], "ids": ids, "logits": None, "decode_start": None}
        tokens: list[int] = []
        originals = {name: getattr(loop, name) for name in ("initialize_medusa", "evaluate_posterior",
                                                            "update_inference_inputs")}

        def initialize_medusa(*args, **kwargs):  # the prompt's prefill: decode time starts after it
            out = originals["initialize_medusa"](*args, **kwargs)
            synchronize(device)
            seen["decode_start"] = time.perf_counter_ns()
            return out

        def evaluate_posterior(*args, **kwargs):
            best, accept = originals["evaluate_posterior"](*args, **kwargs)
            seen["accept"].append(int(accept))
            return best, accept

        def update_inference_inputs(*args, **kwargs):
            out = originals["update_inference_inputs"](*args, **kwargs)
            seen["ids"], seen["logits"] = out[0], out[1]
            return out

        patched = {"initialize_medusa": initialize_medusa, "evaluate_posterior": evaluate_posterior,
                   "update_inference_inputs": update_inference_inputs}
        try:
            for name, fn in patched.items():
                setattr(loop, name, fn)
            with torch.inference_mode():
                for _ in self.model.medusa_generate(ids, temperature=0.0, max_steps=max_new_tokens,
                                                    medusa_choices=[1, *self.topk]):
                    # Its step k emits root_k (our bonus of step k-1) and the accepted drafts; root_{k+1} is
                    # already decided (its generate_candidates takes the argmax of these logits), so it is
                    # counted now, as our engine counts its bonus: same steps for the same tokens.
                    tokens = seen["ids"][0, n:].tolist() + [int(seen["logits"][:, -1].argmax())]
                    if len(tokens) >= max_new_tokens or self.eos.intersection(tokens):
                        break
            synchronize(device)
            end = time.perf_counter_ns()
        finally:
            for name, fn in originals.items():
                setattr(loop, name, fn)
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens = tokens[: i + 1]
                break
        return ReferenceOutput(tokens[:max_new_tokens], seen["accept"], (end - (seen["decode_start"] or end)) / 1e9)
