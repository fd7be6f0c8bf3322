"""Model sources and tokenizers, without weights: what the gateway needs (it tokenizes, it never
runs a model), and what `specmesh.runtime.models` builds on.

transformers reads the tokenizer out of a GGUF file only with torch installed, which a
gateway-only install (`pip install specmesh`) lacks. So the replica that loads a GGUF also saves its
tokenizer beside it as a plain tokenizer folder (`save_tokenizer_folder`), and the gateway, which
loads the tokenizer from the verifier's model id (that GGUF's path), reads that folder when it is
there. The gateway checks the tokenizer's fingerprint against the verifier's either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from specmesh.runtime import model_store

FOLDER_INFO = "specmesh-tokenizer.json"  # in a tokenizer folder: the GGUF, fingerprint, context


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
    says (max_position_embeddings), for the gateway, which only tokenizes. A GGUF's comes from the
    tokenizer folder beside it when a replica saved one (`save_tokenizer_folder`)."""
    from transformers import AutoTokenizer

    location, extra = resolve_source(source)
    if "gguf_file" in extra:
        folder = tokenizer_folder(Path(location) / extra["gguf_file"])
        if (info := _folder_info(folder)) is not None:
            return AutoTokenizer.from_pretrained(str(folder)), info.get("context")
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    return tokenizer, _context_length(location, extra)


def _context_length(location: str, extra: dict[str, Any]) -> int | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(location, **extra).get_text_config()
    except (OSError, ValueError):  # a tokenizer-only folder
        return None
    return getattr(config, "max_position_embeddings", None)


def tokenizer_folder(gguf: Path) -> Path:
    """Where the tokenizer of the GGUF file `gguf` is saved as a plain tokenizer folder."""
    return gguf.with_name(f"{gguf.name}.tokenizer")


def _folder_info(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / FOLDER_INFO).read_text())
    except (OSError, ValueError):
        return None


def save_tokenizer_folder(gguf: Path, tokenizer: Any) -> Path | None:
    """Save the GGUF's `tokenizer` (as transformers read it from the file) and the model's context
    length into `tokenizer_folder(gguf)`, for gateways without torch; a folder with the same
    fingerprint is kept. Replicas starting together may race: each writes its own copy, and one
    rename wins. None when the folder cannot be written (a read-only model directory, say)."""
    folder, fingerprint = tokenizer_folder(gguf), tokenizer_fingerprint(tokenizer)
    if (_folder_info(folder) or {}).get("fingerprint") == fingerprint:
        return folder
    if not os.access(gguf.parent, os.W_OK):
        return None
    info = {
        "gguf": gguf.name,
        "fingerprint": fingerprint,
        "context": _context_length(str(gguf.parent), {"gguf_file": gguf.name}),
    }
    tmp, stale = (folder.with_name(f"{folder.name}.{os.getpid()}.{what}") for what in ("tmp", "stale"))
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / FOLDER_INFO).write_text(json.dumps(info))  # written last: the folder is complete
        if folder.exists():
            folder.rename(stale)
        tmp.rename(folder)
    except OSError:
        if (_folder_info(folder) or {}).get("fingerprint") != fingerprint:  # not another replica's copy
            return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    return folder
