"""Model runtime: load a causal LM + tokenizer for drafting or verification, and check a pair.

`load_model` accepts a local folder, a `.gguf` file, a hub id, or "default-draft" /
"default-target" (the offline pair of docs/architecture.md, provisioned on first use by
`specmesh.runtime.model_store`). Models come back in eval mode with sdpa attention, because tree
verification passes 4D boolean masks and only sdpa reads those correctly (eager adds them).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmesh.runtime import model_store
from specmesh.runtime.model_store import cache_dir

__all__ = [
    "LoadedModel",
    "cache_dir",
    "check_pair",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "tokenizer_fingerprint",
]

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A ready-to-run model with what the runtime needs to know about it."""

    model: Any  # transformers PreTrainedModel (causal LM), eval mode, no grads
    tokenizer: Any  # transformers tokenizer
    source: str
    dtype: torch.dtype
    device: torch.device
    vocab_size: int  # width of the logits
    tokenizer_fingerprint: str  # sha256 of vocab + special ids; equal means same tokenization
    weights: str = ""  # how the weights are stored: "bfloat16", "float32", ..., or "int8"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """None means bfloat16: on the AVX-512-bf16 CPUs and on GPUs it is 2–3× faster than fp32."""
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[key]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the sorted vocabulary and the special token ids (canonical JSON)."""
    specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    payload = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items()), "special_ids": specials},
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _resolve_source(source: str | Path) -> tuple[str, dict[str, Any]]:
    """-> (what from_pretrained gets, extra kwargs) for a folder, .gguf file, alias or hub id."""
    text = str(source)
    if text in model_store.DEFAULT_SOURCES:
        return str(model_store.pull_model(model_store.DEFAULT_SOURCES[text])), {}
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    if path.suffix == ".gguf" or text.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"model source {text!r} does not exist")
    return text, {}  # a hub id


def load_model(
    source: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
) -> LoadedModel:
    """Load a causal LM and its tokenizer; see the module docstring for accepted sources.

    dtype "int8" keeps fp32 activations and stores every Linear's weights in int8 (PyTorch
    dynamic quantization, CPU only). Meant for drafters: decoding on a CPU is bound by reading the
    weights, so int8 weights make a draft forward ~2x faster. Verification stays exact whatever
    the draft computes; only the acceptance rate can change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantize = str(dtype).lower() == "int8"
    torch_dtype = torch.float32 if quantize else resolve_dtype(dtype)
    torch_device = resolve_device("cpu" if quantize and device is None else device)
    if quantize and torch_device.type != "cpu":
        raise ValueError("dtype int8 (dynamic quantization) runs on the CPU only")
    location, extra = _resolve_source(source)
    with torch.no_grad():
        tokenizer = AutoTokenizer.from_pretrained(location, **extra)
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=torch_dtype, attn_implementation="sdpa", **extra
        )
    # Make dtype and device certain whatever the loader did (a no-op when it honoured them).
    model = model.to(device=torch_device, dtype=torch_dtype).eval().requires_grad_(False)
    if quantize:
        model = _quantize_int8(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=str(source),
        dtype=torch_dtype,
        device=torch_device,
        vocab_size=int(model.config.get_text_config().vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        weights="int8" if quantize else str(torch_dtype).removeprefix("torch."),
    )


def _quantize_int8(model: Any) -> Any:
    with warnings.catch_warnings():  # torch.ao announces its move to torchao; the API still works
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def load_tokenizer(source: str | Path) -> tuple[Any, int | None]:
    """The tokenizer of a model source (no weights) and the model's context length if its config
    says (max_position_embeddings), for the gateway, which only tokenizes."""
    from transformers import AutoConfig, AutoTokenizer

    location, extra = _resolve_source(source)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    try:
        config = AutoConfig.from_pretrained(location, **extra).get_text_config()
    except (OSError, ValueError):  # a tokenizer-only folder
        return tokenizer, None
    return tokenizer, getattr(config, "max_position_embeddings", None)


def check_pair(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft/target pair that does not share vocabulary and tokenizer."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft and target vocab sizes differ: draft {draft.source!r} has {draft.vocab_size}, "
            f"target {target.source!r} has {target.vocab_size}"
        )
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise ValueError(
            f"draft and target tokenizers differ: draft {draft.source!r} fingerprint "
            f"{draft.tokenizer_fingerprint}, target {target.source!r} fingerprint "
            f"{target.tokenizer_fingerprint}"
        )
