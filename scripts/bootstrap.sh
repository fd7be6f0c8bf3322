#!/usr/bin/env bash
# Create .venv and install specmesh editable with its test and benchmark tools (extras `test`, `bench`;
# grpcio-tools among them, which a source checkout needs to generate specmesh/v1). Idempotent.
# torch is installed first and pinned, so a CPU machine takes the local CPU build (no CUDA wheels).
# llama-cpp-python builds llama.cpp from its sdist (cmake + a C++ compiler, ~10-20 min on 2 cores
# the first time; pip caches the wheel): without the multimodal tools, which specmesh never uses.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
