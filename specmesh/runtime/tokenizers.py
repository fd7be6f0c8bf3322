"""Model sources and tokenizers, without weights: what the gateway needs (it tokenizes, it never
runs a model), and what `specmesh.runtime.models` builds on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from specmesh.runtime import model_store


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the sorted vocabulary and the special token ids (canonical JSON)."""
    specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    payload = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items()), "special_ids": specials},
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def resolve_source(source: str | Path) -> tuple[str, dict[str, Any]]:
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


def gguf_file(source: str | Path) -> Path | None:
    """The GGUF file a source names (the default pair's are assembled on first use), else None."""
    text = str(source)
    if text in model_store.DEFAULT_SOURCES:
        return model_store.pull_gguf(model_store.DEFAULT_SOURCES[text])
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model source {text!r} does not exist")
        return path
    return None


def load_tokenizer(source: str | Path) -> tuple[Any, int | None]:
    """The tokenizer of a model source (no weights) and the model's context length if its config
    says (max_position_embeddings), for the gateway, which only tokenizes."""
    from transformers import AutoConfig, AutoTokenizer

    location, extra = resolve_source(source)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    try:
        config = AutoConfig.from_pretrained(location, **extra).get_text_config()
    except (OSError, ValueError):  # a tokenizer-only folder
        return tokenizer, None
    return tokenizer, getattr(config, "max_position_embeddings", None)
