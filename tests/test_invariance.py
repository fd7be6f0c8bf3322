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
from typing import Any

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
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """The tiny model in f32 and quantized to Q4_K_M by llama.cpp."""
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
    return {"f32": f32, "q4_k_m": out}


@pytest.fixture(scope="module")
def q4_k_m(tiny_ggufs) -> Path:
    return tiny_ggufs["q4_k_m"]


PROBE = """
import dataclasses, json, sys
from specmesh.bench.invariance import probe
from specmesh.runtime.llama_cpp import LlamaCppRunner
gguf, deterministic, length = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
prompt = [259 + (i * 7) % 60 for i in range(length)]  # words of tests.tiny_gguf's vocabulary
other = [259 + (i * 13 + 3) % 60 for i in range(60)]
def runner():
    return LlamaCppRunner(gguf, n_ctx=4096, n_seq_max=64, deterministic=deterministic)
cases = probe(runner, prompt, other)
print(json.dumps([dataclasses.asdict(c) for c in cases]))
"""


def _in_process(program: str, *argv: str) -> Any:
    """`program` in a Python process of its own (llama.cpp reads GGML_CPU_TILED_MM once per
    process) -> the JSON of its last line of output."""
    done = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_probe(gguf: Path, deterministic: bool, length: int = 60) -> dict[str, dict]:
    """The probe on a prompt of `length` tokens -> its cases by name."""
    cases = _in_process(PROBE, str(gguf), "1" if deterministic else "0", str(length))
    return {c["name"]: c for c in cases}


def test_the_self_test_catches_the_default_kernels(q4_k_m) -> None:
    """The default setting's row-count kernels (the tiled K-quant matmul from 8 rows, repacked
    weights from 4) change a row's logits: the self-test sees it, so it can fail."""
    cases = run_probe(q4_k_m, deterministic=False)
    assert set(cases) == {
        *(f"{kind} {k}" for kind in ("own", "beside", "tree") for k in SIZES), "late", "churned", "reordered",
        "cached prefix", "shared prefix", "chunked 16",
    }  # fmt: skip
    differing = [name for name, c in cases.items() if c["differing"]]
    assert differing and all(cases[n]["max_abs_diff"] > 0 for n in differing)


@pytest.mark.parametrize("length", [60, 600], ids=["60 cells", "600 cells"])
def test_the_deterministic_setting_makes_rows_independent_of_their_forward(q4_k_m, length) -> None:
    """--deterministic: the row is bit-identical in a prefill chunk of its own, beside other
    sessions' rows, as a tree node among 1-31 siblings, and alone again after the cache filled or
    churned; with 600 cells too (a one-row forward over 512+ cells would split its attention over
    the threads, were K and V of one type), and in the hole a rejected sibling left (`reordered`:
    the deterministic cache is append-only, so the hole is not reused)."""
    cases = run_probe(q4_k_m, deterministic=True, length=length)
    assert {n: c["differing"] for n, c in cases.items()} == dict.fromkeys(cases, 0)


def test_an_append_only_cache_keeps_a_sessions_cells_in_position_order(tiny_ggufs) -> None:
    """Flash attention sums a row's cells in cache order; a cache that reuses holes puts the row
    before its session's earlier tokens after a rejected sibling (`reordered`). On f32 weights,
    where a changed last bit is not absorbed by 8-bit activations, that changed 281 logits before
    the deterministic cache became append-only. (f32 weights take tinyBLAS's row-count kernels,
    so only the one-row layouts are compared here.)"""
    cases = run_probe(tiny_ggufs["f32"], deterministic=True)
    one_row = ["late", "churned", "reordered"]
    assert {n: cases[n]["differing"] for n in one_row} == dict.fromkeys(one_row, 0)


RESTART = """
import json, sys
import numpy as np
from specmesh.runtime.backend import Step
from specmesh.runtime.llama_cpp import LlamaCppRunner
from specmesh.services.metrics import ServiceMetrics
gguf = sys.argv[1]
prompt = [259 + (i * 7) % 60 for i in range(40)]
other = [259 + (i * 13 + 3) % 60 for i in range(60)]
def runner():
    return LlamaCppRunner(gguf, n_ctx=256, n_seq_max=16, deterministic=True)
fresh = runner()
fresh.forward([Step("s", prompt[:-1])])
alone = fresh.forward([Step("s", prompt[-1:])])[0][-1].numpy()
r = runner()
r.forward([Step("s", prompt[:-10])])
for i in range(12):  # other sessions come and go, trees are rejected: the log runs past 256 cells
    r.forward([Step(f"o{i}", other[: 10 + i]), Step("s", node_tokens=other[:3], node_parents=[-1, 0, -1])])
    r.commit("s", [])
    r.release(f"o{i}")
r.forward([Step("s", prompt[-10:-1])])
row = r.forward([Step("s", prompt[-1:])])[0][-1].numpy()
metrics = ServiceMetrics("tiny")  # what a replica exports, observed as its model thread does
metrics.observe_runner(r)
counted = metrics.log_restarts._value.get()
differing = int(np.count_nonzero(row != alone))
print(json.dumps({"restarts": r.stats["log_restarts"], "counted": counted, "differing": differing}))
"""


def test_a_deterministic_cache_that_fills_restarts_its_log_and_stays_invariant(q4_k_m) -> None:
    """The append-only cache of the deterministic setting: when its log reaches the end of the
    cache, every session is dropped and re-fed in order; the row is still the alone row's bits,
    and the replica's metrics count the restarts (`specmesh:kv_log_restarts_total`)."""
    result = _in_process(RESTART, str(q4_k_m))
    assert result["restarts"] >= 1 and result["differing"] == 0, result
    assert result["counted"] == result["restarts"], result
