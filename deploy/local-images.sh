#!/usr/bin/env bash
# Images for a machine that reaches Debian's mirror and PyPI but no Docker registry:
#   local/debian:bookworm   a minimal Debian base made by debootstrap (stands in for python:3.11-slim)
#   local/postgres:15       PostgreSQL 15 from Debian's packages, with the variables, data directory
#                           and pg_isready of the official postgres:15 (stands in for postgres:15)
# It also copies the CPU torch wheel into deploy/wheels/ (gitignored) for the build context.
# Used by docker-compose.local.yml. Runs as root; each image is built once (FORCE=1 rebuilds).
set -euo pipefail
cd "$(dirname "$0")"

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}

have() { [ "${FORCE:-0}" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }

if ! have local/debian:bookworm; then
  root=$(mktemp -d /tmp/prefixrag-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase bookworm "$root" "$MIRROR"
  # the image's apt uses the same mirror; no caches or lists are kept in the base
  echo "deb $MIRROR bookworm main" >"$root/etc/apt/sources.list"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
  tar -C "$root" -c . | docker import - local/debian:bookworm
fi

if ! have local/postgres:15; then
  docker build -t local/postgres:15 -f postgres.Dockerfile .
fi

mkdir -p wheels
[ -f "wheels/$(basename "$TORCH_WHEEL")" ] || cp "$TORCH_WHEEL" wheels/
