#!/usr/bin/env bash
# Build the local base image trireme-base:bookworm (Debian bookworm + python3 3.11 + venv +
# ca-certificates) from a debootstrap minbase rootfs, for machines that cannot pull
# python:3.11-slim-bookworm from a registry.
#
#   deploy/docker/build-base.sh [ROOTFS_DIR]
#
# ROOTFS_DIR (or $TRIREME_BASE_ROOTFS): an existing `debootstrap --variant=minbase bookworm`
# tree; it is read, never modified. Without one, debootstrap runs into a temporary directory
# (needs root and debootstrap; $DEBIAN_MIRROR picks the mirror).
# $TRIREME_BASE_IMAGE names the result (default trireme-base:bookworm).
#
# Steps: tar the rootfs (without apt's package cache and lists) into `docker import`, install
# the packages with deploy/docker/Dockerfile.base (apt over http://deb.debian.org, signed by
# the Debian archive keys: no CA bundle needed), then flatten the result into one layer
# (docker export | docker import) so that what the install step deleted takes no space.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
image="${TRIREME_BASE_IMAGE:-trireme-base:bookworm}"
rootfs="${1:-${TRIREME_BASE_ROOTFS:-}}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tag_suffix="$$"
rootfs_image="trireme-base-rootfs:tmp-${tag_suffix}"
build_image="trireme-base-build:tmp-${tag_suffix}"
tmpdir=""
container=""

cleanup() {
    [[ -n "$container" ]] && docker rm -f "$container" >/dev/null 2>&1 || true
    docker rmi -f "$build_image" "$rootfs_image" >/dev/null 2>&1 || true
    [[ -n "$tmpdir" ]] && rm -rf "$tmpdir" || true
}
trap cleanup EXIT

if [[ -z "$rootfs" ]]; then
    command -v debootstrap >/dev/null || { echo "debootstrap not found: install it or pass a rootfs" >&2; exit 1; }
    [[ $(id -u) -eq 0 ]] || { echo "debootstrap needs root (or pass an existing rootfs)" >&2; exit 1; }
    tmpdir="$(mktemp -d /var/tmp/trireme-base.XXXXXX)"
    rootfs="$tmpdir/rootfs"
    echo "debootstrap --variant=minbase bookworm -> $rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror"
fi
[[ -x "$rootfs/bin/sh" && -f "$rootfs/etc/debian_version" ]] \
    || { echo "$rootfs does not look like a Debian rootfs" >&2; exit 1; }
echo "rootfs: $rootfs (Debian $(cat "$rootfs/etc/debian_version"))"

# 1. the rootfs as an image; package cache, lists and the host's leftovers are not needed
tar -C "$rootfs" --numeric-owner \
    --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*' \
    --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' --exclude='./tmp/*' \
    --exclude='./debootstrap' -c . \
  | docker import - "$rootfs_image" >/dev/null

# 2. python3, venv, ca-certificates, security updates. The context is an empty directory:
#    Dockerfile.base copies nothing in.
ctx="$(mktemp -d)"
log="$(mktemp)"
if ! docker build --build-arg ROOTFS_IMAGE="$rootfs_image" -t "$build_image" \
        -f "$here/Dockerfile.base" "$ctx" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    rm -rf "$ctx" "$log"
    echo "building $image failed" >&2
    exit 1
fi
rm -rf "$ctx" "$log"

# 3. one layer: export the filesystem, import it with the configuration the build set
container="$(docker create "$build_image" /bin/true)"
docker export "$container" | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "trireme-base: debian bookworm minbase + python3 python3-venv ca-certificates" \
    - "$image" >/dev/null

docker run --rm "$image" python3 -c 'import sys, venv, ensurepip, ssl; print("python", sys.version.split()[0])'
size="$(docker image inspect -f '{{.Size}}' "$image")"
echo "$image: $(awk -v s="$size" 'BEGIN { printf "%.1f MB (%d bytes)", s / 1e6, s }')"
