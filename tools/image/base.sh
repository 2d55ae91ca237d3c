#!/usr/bin/env bash
# A python:3.11-slim-like base image made with debootstrap, for machines that reach a Debian
# mirror but no container registry: Debian bookworm (minbase) with python3.11 in a venv at
# /opt/python whose bin/ is first on PATH, so the Dockerfile's `python -m pip` and its
# `python -m` entrypoint find the same interpreter, as /usr/local/bin/python is in python:3.11-slim.
# The C compiler is not here: the Dockerfile installs it on either base.
#
#   tools/image/base.sh            # makes localhost/loramesh-base:bookworm unless it exists
#   FORCE=1 tools/image/base.sh    # makes it again
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-localhost/loramesh-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
buildah() { command buildah --storage-driver vfs "$@"; }

if [ -z "${FORCE:-}" ] && buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base: $BASE_IMAGE exists (FORCE=1 makes it again)"
    exit 0
fi

rootfs=$(mktemp -d /var/tmp/loramesh-base.XXXXXX)
# mktemp makes it 0700: apt drops to its _apt user to download, which must reach the root.
chmod 755 "$rootfs"
ctr=""
cleanup() {
    [ -n "$ctr" ] && buildah rm "$ctr" >/dev/null 2>&1
    rm -rf "$rootfs"
}
trap cleanup EXIT

# python3-distutils by name: python3.11-venv depends on python3.11-distutils, which it provides,
# and debootstrap does not resolve virtual packages.
debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-distutils,ca-certificates \
    bookworm "$rootfs" "$MIRROR"
# debootstrap installs the release as it was; the updates and security suites bring it up to
# date, as the Debian images on a registry are, and let the Dockerfile's apt-get find them too.
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
SOURCES
# As in debian:bookworm-slim (python:3.11-slim's base), dpkg installs no documentation but the
# copyright files, no manuals and no translations, here and in the image's later apt-get.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EXCLUDES'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EXCLUDES
find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/usr/share/lintian/*
chroot "$rootfs" apt-get update -qq
# No pty for dpkg's log: the chroot has no /dev/pts, and apt says so with an "E:" line.
chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Use-Pty=0 upgrade -y -qq
chroot "$rootfs" apt-get clean
# The venv's pip is the one ensurepip bundles; the system python stays untouched, and Debian's
# "externally managed" marker applies only outside the venv.
chroot "$rootfs" /usr/bin/python3.11 -m venv /opt/python
chroot "$rootfs" /opt/python/bin/python -m pip --version
# What debootstrap downloaded and the package lists are not part of an image.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*

ctr=$(buildah from scratch)
mnt=$(buildah mount "$ctr")
tar -C "$rootfs" --numeric-owner -cf - . | tar -C "$mnt" --numeric-owner -xpf -
buildah umount "$ctr" >/dev/null
buildah config \
    --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --cmd python \
    --label org.opencontainers.image.description="Debian bookworm minbase with python3.11 (debootstrap)" \
    "$ctr"
buildah commit --rm "$ctr" "$BASE_IMAGE"
ctr=""
echo "base: $BASE_IMAGE made"
