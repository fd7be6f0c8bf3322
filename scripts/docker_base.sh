#!/usr/bin/env bash
# The base image of docker/Dockerfile made here, from Debian's own packages, for machines that
# cannot pull python:3.11-slim: a minimal Debian root made with debootstrap, imported with
# `docker import`. Then build any role on it:
#
#   sudo bash scripts/docker_base.sh                          # -> specmesh-base:bookworm
#   docker build -f docker/Dockerfile --target gateway --build-arg BASE_IMAGE=specmesh-base:bookworm .
#   SPECMESH_BASE_IMAGE=specmesh-base:bookworm docker compose build   # every role (docker-compose.yml)
#
#   bash scripts/docker_base.sh --root-only DIR   # make the root in DIR and stop (no Docker needed)
#
# The root has Debian's python3 (3.11 on bookworm) with venv and pip, CA certificates, and
# libgomp1 (llama.cpp's OpenMP runtime); its apt sources are the mirror it came from, so the
# Dockerfile's build stage can still apt-get install cmake and g++. Needs root (debootstrap
# chroots); installs Debian's debootstrap package when it is missing.
set -euo pipefail
SUITE=${SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,python3-pip,ca-certificates,libgomp1
ROOT_ONLY=""
if [ "${1:-}" = "--root-only" ]; then
    ROOT_ONLY=${2:?usage: docker_base.sh --root-only DIR}
    shift 2
fi
TAG=${1:-specmesh-base:$SUITE}
START=$SECONDS
step() { printf '[docker_base %4ds] %s\n' "$((SECONDS - START))" "$*"; }

if [ "$(id -u)" != 0 ]; then
    echo "docker_base.sh: debootstrap needs root (run it with sudo)" >&2
    exit 1
fi
if [ -z "$ROOT_ONLY" ] && ! docker info >/dev/null 2>&1; then
    echo "docker_base.sh: no Docker daemon (docker info failed); --root-only DIR makes the root alone" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null; then
    step "apt-get install debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

if [ -n "$ROOT_ONLY" ]; then
    ROOT=$ROOT_ONLY
    mkdir -p "$ROOT"
else
    WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/specmesh-base.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    ROOT=$WORK/root
fi

step "debootstrap --variant=minbase $SUITE ($MIRROR) into $ROOT"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 \
    || { tail -30 "$ROOT.debootstrap.log" >&2; exit 1; }
rm -f "$ROOT.debootstrap.log"
# what a container never needs: downloaded .debs, apt's lists (the Dockerfile runs apt-get update
# first), documentation and manual pages
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* \
    "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/*
# The host's own certificate authorities (update-ca-certificates' local ones): where HTTPS goes
# through a proxy that re-signs it, the image's pip and apt reach PyPI and Debian as the host does.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    chroot "$ROOT" update-ca-certificates >/dev/null 2>&1
    step "added the host's local CAs: $(cd /usr/local/share/ca-certificates && echo *.crt)"
fi
step "root ready: $(du -sh "$ROOT" | cut -f1), $(chroot "$ROOT" python3 --version)"

if [ -n "$ROOT_ONLY" ]; then
    step "--root-only: not imported into Docker"
    exit 0
fi
step "docker import -> $TAG"
tar --numeric-owner -C "$ROOT" -cf - . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >/dev/null
step "imported: $TAG, $(docker image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec) in Docker"
