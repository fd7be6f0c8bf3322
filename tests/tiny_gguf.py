"""Tiny GGUF models for the llama.cpp backend's tests, written here with the `gguf` package (never
downloaded): the weights of `tests.tiny.tiny_lm("llama", ...)` in f32, and a SentencePiece-style
vocabulary (specials, the 256 byte tokens, then words) that llama.cpp loads.

The Q and K projections are permuted the way llama.cpp's own converter does (llama.cpp applies
RoPE to adjacent pairs, transformers to halves), so the GGUF computes what the transformers model
computes, up to float rounding."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tests.tiny import tiny_lm

SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def vocabulary(n_words: int) -> list[str]:
    return SPECIALS + BYTES + [f"▁w{i}" for i in range(n_words)]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_gguf(model: torch.nn.Module, path: Path, n_words: int) -> Path:
    """A transformers Llama with the vocabulary of `vocabulary(n_words)` as one f32 GGUF; -> path."""
    tokens = vocabulary(n_words)
    cfg = model.config
    if cfg.vocab_size != len(tokens):
        raise ValueError(f"the model has {cfg.vocab_size} tokens, the vocabulary {len(tokens)}")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("specmesh-tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * (len(SPECIALS) + len(BYTES)) + [-float(i) for i in range(n_words)])
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * len(BYTES) + [gguf.TokenType.NORMAL] * n_words
    writer.add_token_types([int(t) for t in types])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        name = names.get_name(hf_name.removesuffix(".weight"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_tiny_gguf(path: Path, n_words: int = 64) -> Path:
    """tiny_lm("llama") (seed 0) as a GGUF."""
    model = tiny_lm("llama", len(vocabulary(n_words)), bos_token_id=1, eos_token_id=2)
    return save_gguf(model, path, n_words)


def save_tiny_gguf_pair(root: Path, n_words: int = 64) -> dict[str, Path]:
    """tests.test_engine's tiny pair (a sharpened target, a noisy copy as the draft) as GGUFs."""
    from tests.test_engine import tiny_pair

    # less noise than test_engine's pair: with 3x the vocabulary, argmax margins are thinner
    vocab = len(vocabulary(n_words))
    draft, target = tiny_pair("llama", vocab, noise=0.005, bos_token_id=1, eos_token_id=2)
    return {
        "draft": save_gguf(draft, root / "draft.gguf", n_words),
        "target": save_gguf(target, root / "target.gguf", n_words),
    }
