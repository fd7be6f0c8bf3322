"""Model runtime: load a causal LM + tokenizer for drafting or verification, and check a pair.

`load_model` accepts a local folder, a `.gguf` file, a hub id, or "default-draft" /
"default-target" (the offline pair of docs/architecture.md, provisioned on first use by
`specmesh.runtime.model_store`). Models come back in eval mode with sdpa attention, because tree
verification passes 4D boolean masks and only sdpa reads those correctly (eager adds them).

The backend (specmesh.runtime.backend) decides what runs the weights: `torch` loads them into a
transformers model (a GGUF is dequantised), `llama.cpp` runs a GGUF file as it is (its quantised
weights are then the model whose distribution is preserved), `auto` picks llama.cpp for a GGUF
model (the default pair included) on a machine without a GPU when llama-cpp-python is installed.
`LoadedModel.open_runner` gives the backend's runner.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmesh.runtime import model_store
from specmesh.runtime.backend import Backend, ModelBackend
from specmesh.runtime.model_store import cache_dir
from specmesh.runtime.runner import ModelRunner
from specmesh.runtime.token_runner import TokenRunner
from specmesh.runtime.tokenizers import (
    gguf_file,
    load_tokenizer,
    resolve_source,
    save_tokenizer_folder,
    tokenizer_fingerprint,
)

__all__ = [
    "LoadedModel",
    "cache_dir",
    "check_pair",
    "load_model",
    "load_tokenizer",
    "resolve_backend",
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

    model: Any  # transformers PreTrainedModel (causal LM), eval mode, no grads; None on llama.cpp
    tokenizer: Any  # transformers tokenizer
    source: str
    dtype: torch.dtype
    device: torch.device
    vocab_size: int  # width of the logits
    tokenizer_fingerprint: str  # sha256 of vocab + special ids; equal means same tokenization
    weights: str = ""  # how the weights are stored: "bfloat16", "float32", ..., "int8", or "gguf"
    backend: Backend = Backend.TORCH
    gguf: Path | None = None  # the file the llama.cpp backend runs

    def open_runner(
        self, max_cache_tokens: int | None = None, threads: int = 0, deterministic: bool = False
    ) -> ModelBackend:
        """A new runner of this model's backend (many sessions, one KV budget). deterministic: a
        row's logits do not depend on the forward it shares (llama.cpp's setting, or the torch
        backend's batch-invariant matmuls and attention; an n-gram runner has no arithmetic)."""
        if deterministic and self.weights == "int8":
            raise ValueError(
                "deterministic: int8 weights (dynamic quantization) have no batch-invariant kernels"
            )
        if self.backend is Backend.LLAMA_CPP:
            from specmesh.runtime.llama_cpp import LlamaCppRunner

            return LlamaCppRunner(
                self.gguf, max_cache_tokens=max_cache_tokens, threads=threads, deterministic=deterministic
            )
        if self.backend is Backend.NGRAM:
            return TokenRunner(self.vocab_size, max_cache_tokens)
        return ModelRunner(self.model, max_cache_tokens=max_cache_tokens, deterministic=deterministic)


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


def resolve_backend(backend: str | Backend, source: str | Path) -> Backend:
    """auto -> llama.cpp for a GGUF source on a machine without a GPU (when llama-cpp-python is
    installed), else torch. An explicit llama.cpp needs a GGUF source."""
    from specmesh.runtime.llama_cpp import llama_cpp_available

    try:
        choice = Backend(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(Backend)}") from None
    if choice is Backend.NGRAM:
        return choice
    if choice is Backend.AUTO:
        is_gguf = str(source) in model_store.DEFAULT_SOURCES or Path(str(source)).suffix == ".gguf"
        use_llama = is_gguf and not torch.cuda.is_available() and llama_cpp_available()
        return Backend.LLAMA_CPP if use_llama else Backend.TORCH
    if choice is Backend.LLAMA_CPP and not (
        str(source) in model_store.DEFAULT_SOURCES or Path(str(source)).suffix == ".gguf"
    ):
        raise ValueError(f"the llama.cpp backend runs GGUF files; {str(source)!r} is not one")
    return choice


def load_model(
    source: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    backend: str | Backend = Backend.TORCH,
) -> LoadedModel:
    """Load a causal LM and its tokenizer; see the module docstring for sources and backends.
    dtype and device apply to the torch backend (llama.cpp runs the GGUF's own types on the CPU).

    dtype "int8" keeps fp32 activations and stores every Linear's weights in int8 (PyTorch
    dynamic quantization, CPU only). Meant for drafters: decoding on a CPU is bound by reading the
    weights, so int8 weights make a draft forward ~2x faster. Verification stays exact whatever
    the draft computes; only the acceptance rate can change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chosen = resolve_backend(backend, source)
    if chosen is Backend.LLAMA_CPP:
        return _load_gguf(source)
    if chosen is Backend.NGRAM:
        return _load_vocabulary(source)
    quantize = str(dtype).lower() == "int8"
    torch_dtype = torch.float32 if quantize else resolve_dtype(dtype)
    torch_device = resolve_device("cpu" if quantize and device is None else device)
    if quantize and torch_device.type != "cpu":
        raise ValueError("dtype int8 (dynamic quantization) runs on the CPU only")
    location, extra = resolve_source(source)
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


def _load_gguf(source: str | Path) -> LoadedModel:
    """A GGUF for the llama.cpp backend: its tokenizer through transformers, no weights loaded
    here (the runner maps the file). `source` becomes the file's path, which is what the
    services report and the gateway loads the tokenizer from."""
    import gguf as gguf_lib
    from transformers import AutoTokenizer

    path = gguf_file(source)
    assert path is not None
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    save_tokenizer_folder(path, tokenizer)  # for gateways without torch (specmesh.runtime.tokenizers)
    reader = gguf_lib.GGUFReader(str(path))
    vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        source=str(path),
        dtype=torch.float32,
        device=torch.device("cpu"),
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        weights="gguf",
        backend=Backend.LLAMA_CPP,
        gguf=path,
    )


def _load_vocabulary(source: str | Path) -> LoadedModel:
    """The ngram backend: the model's tokenizer and vocabulary size, no weights (a GGUF's header,
    or a folder's config): what an n-gram drafter for that model's verifier needs."""
    if gguf_file(source) is not None:
        return dataclasses.replace(_load_gguf(source), weights="none", backend=Backend.NGRAM, gguf=None)
    from transformers import AutoConfig

    tokenizer, _ = load_tokenizer(source)
    location, extra = resolve_source(source)
    config = AutoConfig.from_pretrained(location, **extra).get_text_config()
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        source=str(source),
        dtype=torch.float32,
        device=torch.device("cpu"),
        vocab_size=int(config.vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        weights="none",
        backend=Backend.NGRAM,
    )


def _quantize_int8(model: Any) -> Any:
    with warnings.catch_warnings():  # torch.ao announces its move to torchao; the API still works
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


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
