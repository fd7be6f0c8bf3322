#!/usr/bin/env bash
# Build the role images of docker/Dockerfile (gateway, drafter, verifier-cpu, and nginx's proxy) on the Debian root of
# scripts/docker_base.sh, with BuildKit and the host network, and print each one's size and build
# time. Needs a Docker daemon and root (the base).
#
#   bash scripts/docker_images.sh   # -> specmesh:gateway, specmesh:drafter, specmesh:verifier-cpu, specmesh:proxy
#
# torch comes from TORCH_INDEX_URL (the Dockerfile's default: download.pytorch.org's CPU index).
# Where that index does not answer, the CPU wheel this host's pip resolves (`pip download torch`)
# and its dependencies are served as a PEP 503 index on 127.0.0.1 for the build, so that the
# images hold the same torch as the host. The drafter stage compiles llama-cpp-python once;
# verifier-cpu is built on it. BASE_IMAGE: an image to build on instead of the Debian root.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE=${BASE_IMAGE:-specmesh-base:bookworm}
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile | head -1)
PYTHON=${PYTHON:-.venv/bin/python}
START=$SECONDS
step() { printf '[docker_images %4ds] %s\n' "$((SECONDS - START))" "$*"; }
image_id() { "$DOCKER" image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }
# the daemon's own client (Debian's docker.io): BuildKit with RUN --mount, no buildx plugin needed
DOCKER=${DOCKER:-$(command -v /usr/bin/docker || command -v docker)}

if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    [ "$BASE_IMAGE" = specmesh-base:bookworm ] || { echo "no image $BASE_IMAGE" >&2; exit 1; }
    bash scripts/docker_base.sh "$BASE_IMAGE"
fi

INDEX_ARGS=()
if [ -z "${TORCH_INDEX_URL:-}" ] && ! curl -s -m 10 -o /dev/null https://download.pytorch.org/whl/cpu/; then
    INDEX=$(mktemp -d "${TMPDIR:-/tmp}/specmesh-torch-index.XXXXXX")
    trap 'kill "${SERVER:-0}" 2>/dev/null || true; rm -rf "$INDEX"' EXIT
    step "download.pytorch.org does not answer: serving this host's torch==$TORCH_VERSION from $INDEX"
    "$PYTHON" -m pip download -q --dest "$INDEX/files" "torch==$TORCH_VERSION" 2>/dev/null
    for wheel in "$INDEX"/files/*; do
        name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
        mkdir -p "$INDEX/simple/$name" && ln -s "$wheel" "$INDEX/simple/$name/"
    done
    # the same port every build where it is free: the URL is a build argument, part of the cache
    # key of the torch layer, and a new port each time would reinstall torch (an 865 MB layer)
    PORT=$("$PYTHON" -c "
import socket
s = socket.socket()
try:
    s.bind(('127.0.0.1', 38517))
except OSError:
    s.bind(('127.0.0.1', 0))
print(s.getsockname()[1])")
    "$PYTHON" -m http.server "$PORT" --bind 127.0.0.1 --directory "$INDEX" >/dev/null 2>&1 &
    SERVER=$!
    for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$PORT/simple/" && break; sleep 0.1; done
    TORCH_INDEX_URL=http://127.0.0.1:$PORT/simple
fi
[ -n "${TORCH_INDEX_URL:-}" ] && INDEX_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

for target in gateway drafter verifier-cpu proxy; do
    began=$SECONDS
    old=$(image_id "specmesh:$target")
    DOCKER_BUILDKIT=1 "$DOCKER" build --network host -f docker/Dockerfile --target "$target" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" "${INDEX_ARGS[@]}" -t "specmesh:$target" . \
        >"${TMPDIR:-/tmp}/specmesh-build-$target.log" 2>&1 \
        || { tail -40 "${TMPDIR:-/tmp}/specmesh-build-$target.log" >&2; exit 1; }
    # the image this tag named before is left untagged by the build: remove it unless a
    # container still uses it (every rebuild would otherwise keep its layers, ~1.5 GB each)
    if [ -n "$old" ] && [ "$old" != "$(image_id "specmesh:$target")" ]; then
        "$DOCKER" image rm "$old" >/dev/null 2>&1 || true
    fi
    size=$("$DOCKER" image inspect --format '{{.Size}}' "specmesh:$target" | numfmt --to=iec)
    step "specmesh:$target: $size, built in $((SECONDS - began))s"
done
