"""Tiny randomly initialised causal LMs for fast, exact tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specbench.engine.target import Target


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               init: float = 0.2, eos: int | None = None) -> LlamaForCausalLM:
    """A Llama with peaked (non-uniform) next-token distributions, so drafts get rejected."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         initializer_range=init, bos_token_id=None, eos_token_id=eos, pad_token_id=None,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


def tiny_target(seed: int = 0, **kwargs) -> Target:
    return Target(tiny_llama(seed, **kwargs), tokenizer=None, name=f"tiny-{seed}")
