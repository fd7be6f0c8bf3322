#!/usr/bin/env bash
# Create .venv and install specmesh editable with every role and tool: extra `dev` = both model
# backends (`llama`, which includes `torch`), `test` and `bench` (grpcio-tools among them, which a
# source checkout needs to generate specmesh/v1). Idempotent.
# torch is installed first and pinned, so a CPU machine takes the local CPU build (no CUDA wheels).
# llama-cpp-python builds llama.cpp from its sdist (cmake + a C++ compiler, ~10-20 min on 2 cores
# the first time; pip caches the wheel): without the multimodal tools, which specmesh never uses.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
HEARTBEAT=${BOOTSTRAP_HEARTBEAT:-30}  # seconds between "still running" lines of a long step

# Progress: numbered steps, each with what it does and how long it takes, a "still running" line
# every $HEARTBEAT seconds while pip works quietly, and each step's elapsed time.
elapsed() { printf '%dm %02ds' $(($1 / 60)) $(($1 % 60)); }
step() {  # step N TOTAL WHAT CMD...: announce the step, run CMD with a heartbeat, report its time
    local n=$1 total=$2 what=$3 start=$SECONDS beat status=0
    shift 3
    printf '[%s/%s] %s\n' "$n" "$total" "$what"
    (
        while sleep "$HEARTBEAT"; do
            printf '      ... still running (%s)\n' "$(elapsed $((SECONDS - start)))"
        done
    ) &
    beat=$!
    trap 'kill "$beat" 2>/dev/null || true' EXIT
    "$@" || status=$?
    kill "$beat" 2>/dev/null || true
    wait "$beat" 2>/dev/null || true
    trap - EXIT
    if [ "$status" -ne 0 ]; then
        printf '[%s/%s] failed after %s (exit %s)\n' "$n" "$total" "$(elapsed $((SECONDS - start)))" "$status"
        exit "$status"
    fi
    printf '      done in %s\n' "$(elapsed $((SECONDS - start)))"
}
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

if [ -x .venv/bin/python ]; then
    printf '[1/3] .venv exists (%s), kept\n' "$(.venv/bin/python --version 2>&1)"
else
    step 1 3 "creating .venv with $PYTHON (seconds)" "$PYTHON" -m venv .venv
fi
torch="the CPU build on a machine without CUDA; first time a large download, a few minutes; later seconds"
step 2 3 "installing torch==2.13.0 ($torch)" pip_install torch==2.13.0
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF $(bash scripts/llama_cpu_flags.sh)}"  # no AMX where it faults
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if compgen -G '.venv/lib/python*/site-packages/llama_cpp' >/dev/null; then
    built="llama.cpp already built: seconds"
else
    built="first time llama.cpp compiles from source, ~10 min on 2 cores, unless pip cached the wheel"
fi
step 3 3 "installing specmesh (editable) and its dependencies ($built)" pip_install -e '.[dev]'
# pip reuses a wheel it cached from an earlier build whatever CMAKE_ARGS say now: one built with AMX
# kills the default pair where AMX faults (scripts/llama_cpu_flags.sh). Say so, and how to rebuild.
amx_check='import llama_cpp, sys; sys.exit("AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode())'
if [[ "$CMAKE_ARGS" == *GGML_NATIVE=OFF* && "$CMAKE_ARGS" != *AMX* ]] && .venv/bin/python -c "$amx_check" 2>/dev/null; then
    echo "WARNING: llama-cpp-python came from a wheel pip cached with AMX, which faults here. Rebuild it:"
    echo "  .venv/bin/pip cache remove llama_cpp_python && CMAKE_ARGS='$CMAKE_ARGS' .venv/bin/pip install \\"
    echo "      --force-reinstall --no-deps --no-cache-dir llama-cpp-python==\$(.venv/bin/pip show llama-cpp-python | sed -n 's/^Version: //p')"
fi
printf 'ready in %s. Everything is in .venv: `source .venv/bin/activate` (then `specmesh up`), or run `.venv/bin/specmesh up`\n' \
    "$(elapsed "$SECONDS")"
