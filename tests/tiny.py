"""Tiny random causal LMs for tests (never downloaded): 2 layers, hidden 64, fp32, eval mode."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_lm(arch: str, vocab_size: int, **config) -> torch.nn.Module:
    """A Llama or Qwen2 model with seed 0; `config` overrides the defaults below."""
    torch.manual_seed(0)
    config_cls, model_cls = ARCHS[arch]
    defaults = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return model_cls(config_cls(**{**defaults, **config})).eval()
