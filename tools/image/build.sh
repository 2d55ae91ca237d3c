#!/usr/bin/env bash
# `make image`: build the CPU image from the Dockerfile with buildah (vfs storage, chroot
# isolation: no daemon, no overlay mounts, no user namespaces needed), as root.
#
# The base is $BASE when set; else python:3.11-slim when a registry gives it; else a Debian
# base made here with debootstrap (tools/image/base.sh). torch's CPU wheel comes from this
# machine's pip when it finds one (copied into tools/image/pip/), else from TORCH_INDEX_URL
# (the Dockerfile's default: download.pytorch.org). This machine's CA bundle goes with it, so a
# TLS-intercepting proxy that this machine trusts is trusted inside the build too.
#
#   tools/image/build.sh                                   # localhost/loramesh:<version>-cpu
#   BASE=docker.io/library/python:3.11-slim tools/image/build.sh
#   IMAGE=localhost/loramesh:dev PIP_INDEX_URL=https://mirror.example/simple tools/image/build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' mesh_api/version.py)
IMAGE=${IMAGE:-localhost/loramesh:$VERSION-cpu}
REGISTRY_BASE=docker.io/library/python:3.11-slim
DEBIAN_BASE=localhost/loramesh-base:bookworm
PYTHON=${PYTHON:-python3}
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
PIP_DIR=tools/image/pip
buildah() { command buildah --storage-driver vfs "$@"; }

if ! command -v buildah >/dev/null || { [ -z "${BASE:-}" ] && ! command -v debootstrap >/dev/null; }; then
    apt-get update -qq && apt-get install -y -qq buildah debootstrap
fi

start=$(date +%s)
if [ -z "${BASE:-}" ]; then
    if timeout 300 buildah --storage-driver vfs pull --retry 0 "$REGISTRY_BASE" >/dev/null 2>&1; then
        BASE=$REGISTRY_BASE
    else
        echo "image: no registry gives $REGISTRY_BASE; the base is $DEBIAN_BASE (debootstrap)"
        BASE_IMAGE=$DEBIAN_BASE tools/image/base.sh
        BASE=$DEBIAN_BASE
    fi
fi
base_done=$(date +%s)

args=(--build-arg "BASE=$BASE")
# The platform of the image's python whatever this machine runs: the wheel only has to be found.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$PIP_DIR" \
    --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
    torch==2.13.0+cpu >/dev/null 2>&1 || true
# A wheel there, found or put there by hand, is all the build needs: no torch index to ask.
wheel=$(cd "$PIP_DIR" && ls torch-2.13.0+cpu-*.whl 2>/dev/null || true)
if [ -n "$wheel" ]; then
    echo "image: torch's CPU wheel from $PIP_DIR: $wheel"
    args+=(--build-arg TORCH_INDEX_URL=)
fi
if [ -f "$HOST_CA" ]; then
    cp "$HOST_CA" "$PIP_DIR/ca.pem"
    args+=(--build-arg PIP_CERT=/tmp/pip-local/ca.pem)
fi
if [ -n "${PIP_INDEX_URL:-}" ]; then
    args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
fi

previous=$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE" 2>/dev/null || true)
buildah bud --isolation chroot "${args[@]}" --tag "$IMAGE" --file Dockerfile .
end=$(date +%s)
# The image this tag named before is a full copy of its root filesystem under vfs: drop it
# unless a container still uses it.
if [ -n "$previous" ] && [ "$previous" != "$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE")" ]; then
    buildah rmi "$previous" >/dev/null 2>&1 || echo "image: kept the previous $IMAGE ($previous): a container uses it"
fi

echo "image: $IMAGE over $BASE"
echo "image: base $((base_done - start)) s, build $((end - base_done)) s, total $((end - start)) s"
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE"
