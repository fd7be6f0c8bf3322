#!/usr/bin/env bash
# Create .venv and install specmesh with its test tools. Idempotent; safe to run every time.
# torch is installed first and pinned, so a CPU machine takes the local CPU build (no CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
