"""Build hook (everything else is in pyproject.toml): the wheel ships the generated gRPC code.

`build_py` runs grpcio-tools (a [build-system] requirement) on proto/specmesh/v1/*.proto and writes
`specmesh/v1/` into the build, next to a copy of the .proto files as `specmesh/proto/specmesh/v1/`
(PROTO_ROOT of an installed specmesh, for reflection and inspection). An installed wheel therefore
never needs proto/ or grpcio-tools; a source checkout (editable installs included) still
generates `specmesh/v1/` itself on first import (specmesh/rpc/proto.py). Any local, possibly stale
`specmesh/v1/` is never packaged: pyproject.toml excludes it and the build regenerates it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
INIT = '"""Generated at build time by setup.py from proto/specmesh/v1; do not edit."""\n'


def _generate(build_lib: Path) -> None:
    from importlib.resources import files as package_files

    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("specmesh/v1/*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}/specmesh/v1: build from a checkout or sdist")
    out, shipped = build_lib / "specmesh" / "v1", build_lib / "specmesh" / "proto"
    for stale in (out, shipped):  # build/ outlives builds: drop what an earlier one left
        shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{package_files('grpc_tools') / '_proto'}",
        f"--python_out={build_lib}",
        f"--pyi_out={build_lib}",
        f"--grpc_python_out={build_lib}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/specmesh/v1 (see the messages above)")
    (out / "__init__.py").write_text(INIT)
    for p in protos:
        target = shipped / p.relative_to(PROTO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _check_runtime_floors(generated: Path, requires: list[str]) -> None:
    """The generated code refuses to import on an older grpcio / protobuf than the generator's:
    the wheel's own requirements must rule that out."""
    floors = {}
    for req in requires:  # e.g. "protobuf<8,>=7.35.1" (setuptools may reorder the specifiers)
        name = re.match(r"\s*([A-Za-z0-9_.-]+)", req)
        floor = re.search(r">=\s*([0-9]+(?:\.[0-9]+)*)", req)
        if name and floor and name[1].lower() in ("grpcio", "protobuf"):
            floors[name[1].lower()] = _version(floor[1])
    needed = {}
    for f in generated.glob("*_pb2_grpc.py"):
        if m := re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", f.read_text()):
            needed["grpcio"] = max(needed.get("grpcio", ()), _version(m[1]))
    pattern = r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.\w+,\s*(\d+),\s*(\d+),\s*(\d+),"
    for f in generated.glob("*_pb2.py"):
        if m := re.search(pattern, f.read_text()):
            needed["protobuf"] = max(needed.get("protobuf", ()), tuple(int(x) for x in m.groups()))
    for dist, version in needed.items():
        if floors.get(dist, ()) < version:
            raise RuntimeError(
                f"the generated code needs {dist}>={'.'.join(map(str, version))} at run time, but "
                f"pyproject.toml requires {dist}>={'.'.join(map(str, floors.get(dist, ()))) or '(none)'}: "
                "raise that floor, or pin grpcio-tools in [build-system] to an older release"
            )


class BuildPyWithGrpc(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the checkout generates its own code on first import
            return
        build_lib = Path(self.build_lib)
        _generate(build_lib)
        _check_runtime_floors(build_lib / "specmesh" / "v1", self.distribution.install_requires or [])


setup(cmdclass={"build_py": BuildPyWithGrpc})
