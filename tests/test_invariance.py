"""`specmesh bench invariance` (specmesh/bench/invariance.py) on a tiny K-quant GGUF: llama.cpp's
own quantizer turns tests.tiny_gguf's f32 model (hidden 256, so that K-quant blocks fit) into
Q4_K_M, the default pair's format. Each setting runs in its own process: llama.cpp reads
GGML_CPU_TILED_MM once per process, so a default runner before a deterministic one would decide
for both."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specmesh.bench.invariance import SIZES
from specmesh.bench.tiny import tiny_lm
from specmesh.runtime.llama_cpp import llama_cpp_available
from tests.tiny_gguf import save_gguf, vocabulary

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")

LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def _amx_build_that_faults_here() -> str | None:
    """Why this llama.cpp cannot run K-quant kernels on this machine, or None: it was built with
    AMX where AMX faults (scripts/llama_cpu_flags.sh builds without it there; a wheel that pip
    cached from a build with other flags is reused whatever CMAKE_ARGS say)."""
    import llama_cpp

    if "AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode():
        return None
    flags = subprocess.run(
        ["bash", str(ROOT / "scripts" / "llama_cpu_flags.sh")], capture_output=True, text=True, timeout=120
    ).stdout
    if "GGML_NATIVE=OFF" in flags and "AMX" not in flags:
        return (
            "llama-cpp-python was built with AMX, which faults on this machine (a wheel from pip's "
            "cache): `pip cache remove llama_cpp_python`, then reinstall it with bash scripts/bootstrap.sh"
        )
    return None


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    import llama_cpp

    if reason := _amx_build_that_faults_here():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("invariance")
    model = tiny_lm(
        "llama", len(vocabulary(64)), bos_token_id=1, eos_token_id=2, hidden_size=256,
        intermediate_size=512, max_position_embeddings=1024,
    )  # fmt: skip
    f32 = save_gguf(model, root / "f32.gguf", 64)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    out = root / "tiny-q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


PROBE = """
import dataclasses, json, sys
from specmesh.bench.invariance import probe
from specmesh.runtime.llama_cpp import LlamaCppRunner
gguf, deterministic = sys.argv[1], sys.argv[2] == "1"
prompt = [259 + (i * 7) % 60 for i in range(60)]  # words of tests.tiny_gguf's vocabulary
other = [259 + (i * 13 + 3) % 60 for i in range(60)]
def runner():
    return LlamaCppRunner(gguf, n_ctx=4096, n_seq_max=64, deterministic=deterministic)
cases = probe(runner, prompt, other)
print(json.dumps([dataclasses.asdict(c) for c in cases]))
"""


def run_probe(gguf: Path, deterministic: bool) -> dict[str, dict]:
    """The probe in a process of its own -> its cases by name. A 60-token prompt: fewer than 512
    cells in use (a one-row forward over 512+ splits its attention over the threads, which the
    deterministic setting does not avoid yet)."""
    argv = [sys.executable, "-c", PROBE, str(gguf), "1" if deterministic else "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {c["name"]: c for c in json.loads(done.stdout.strip().splitlines()[-1])}


def test_the_self_test_catches_the_default_kernels(q4_k_m) -> None:
    """The default setting's row-count kernels (the tiled K-quant matmul from 8 rows, repacked
    weights from 4) change a row's logits: the self-test sees it, so it can fail."""
    cases = run_probe(q4_k_m, deterministic=False)
    assert set(cases) == {
        *(f"{kind} {k}" for kind in ("own", "beside", "tree") for k in SIZES), "late", "churned",
    }  # fmt: skip
    differing = [name for name, c in cases.items() if c["differing"]]
    assert differing and all(cases[n]["max_abs_diff"] > 0 for n in differing)


def test_the_deterministic_setting_makes_rows_independent_of_their_forward(q4_k_m) -> None:
    """--deterministic: the row is bit-identical in a prefill chunk of its own, beside other
    sessions' rows, and alone again after the cache filled or churned. Trees of siblings are not
    asserted: on this model a few widths still differ (docs/decisions.md, "Batch invariance")."""
    cases = run_probe(q4_k_m, deterministic=True)
    guaranteed = [n for n in cases if not n.startswith("tree")]
    assert {n: cases[n]["differing"] for n in guaranteed} == dict.fromkeys(guaranteed, 0)


def test_only_llama_cpp_has_a_deterministic_setting(tmp_path) -> None:
    """--deterministic on a torch replica is refused at start, naming the setting, not ignored."""
    from specmesh.bench.tiny import save_tiny_pair
    from specmesh.runtime.models import load_model

    target = load_model(save_tiny_pair(tmp_path)["target"], dtype="fp32", backend="torch")
    with pytest.raises(ValueError, match=r"deterministic: only the llama\.cpp backend"):
        target.open_runner(deterministic=True)
