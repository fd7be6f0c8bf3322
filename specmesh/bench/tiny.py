"""Tiny random causal LMs made on the spot (never downloaded): for the tests, and for benchmarks
that measure the serving machinery rather than a model (`specmesh bench dsi-stack`).

A pair is a target and a draft that is a noisy copy of it, so that they agree often but not always;
`save_tiny_pair` writes both with an offline word-level tokenizer (words w0, w1, ..., specials
<unk> <s> </s> <pad>) that has a chat template.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB = 97
# Renders the messages as "role content ..." and ends with w0, the "assistant turn" marker.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w0{% endif %}"
)


def tiny_lm(arch: str, vocab_size: int, **config) -> torch.nn.Module:
    """A Llama or Qwen2 model with seed 0: 2 layers, hidden 64, fp32, eval mode; `config`
    overrides the defaults."""
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


def tiny_pair(
    arch: str, vocab: int = VOCAB, noise: float = 0.02, **config
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny random target and a draft that is a noisy copy of it (it agrees often, not always)."""
    target = tiny_lm(arch, vocab, attn_implementation="sdpa", **config)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen them so argmax is stable
        target.lm_head.weight.mul_(8.0)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise)
    return draft, target


def make_tokenizer(n_words: int = 96, prefix: str = "w") -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [f"{prefix}{i}" for i in range(n_words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with no merges: one token per byte (GPT-2's byte-to-character map), then the
    specials. Any text tokenizes, so a grammar (JSON, a regex) can be followed token by token."""
    chars = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(chars, key=lambda c: _GPT2_BYTE_OF[c])
    vocab = {c: i for i, c in enumerate(byte_chars)} | {s: 256 + i for i, s in enumerate(SPECIALS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def _gpt2_byte_of() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character that stands for each byte -> the byte."""
    ranges = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = {b for first, last in ranges for b in range(ord(first), ord(last) + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_GPT2_BYTE_OF = _gpt2_byte_of()
BYTE_VOCAB = 256 + len(SPECIALS)
# With tools it names them and teaches Hermes-style calls (<tool_call>...</tool_call>), as Qwen2.5's
# template does (the gateway picks its tool-call parser by the template); short, for a 256-token context.
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}; call one as "
    "<tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_pair(
    root: Path, noise: float = 0.02, byte_level: bool = False, eos: bool = True, **config
) -> dict[str, Path]:
    """A tiny Llama target and its noisy copy as the draft, saved under root/draft and root/target
    with the word-level tokenizer and its chat template (byte_level: the byte tokenizer,
    `make_byte_tokenizer`, for structured output). eos False: the tokenizer names no
    end-of-sequence token, so generations run to their length (a random model emits </s> now and
    then). config: the models' (max_position_embeddings=512, ...)."""
    if byte_level:
        tokenizer, vocab = make_byte_tokenizer(), BYTE_VOCAB
    else:
        tokenizer, vocab = make_tokenizer(VOCAB - len(SPECIALS)), VOCAB
        tokenizer.chat_template = CHAT_TEMPLATE
    if not eos:
        tokenizer.eos_token = None
    out = {}
    pair = tiny_pair("llama", vocab=vocab, noise=noise, **config)
    for name, model in zip(("draft", "target"), pair, strict=True):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = root / name
    return out


def emulated_stack_flags(
    draft: Path, target: Path, verifiers: int, drafter_flags: str, verifier_flags: str, gateway_flags: str
) -> list[str]:
    """`specmesh up` flags for a tiny pair in fp32 with one drafter and `verifiers` verifiers, each
    service on one torch thread plus its own flags (the emulated forward costs)."""
    return [
        *("--draft", str(draft), "--target", str(target), "--dtype", "fp32", "--draft-dtype", "fp32"),
        *("--drafters", "1", "--verifiers", str(verifiers)),
        *("--drafter-flags", f"--torch-threads 1 {drafter_flags}"),
        *("--verifier-flags", f"--torch-threads 1 {verifier_flags}"),
        *("--gateway-flags", gateway_flags),
    ]
