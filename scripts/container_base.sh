#!/usr/bin/env bash
# A Debian base image for the service's image, made from Debian packages where no image registry is reachable
# (the test machines): bookworm's minimal system with Python 3.11 and its venv module, imported into podman.
#   bash scripts/container_base.sh [image name]      (default localhost/routing-replay-base:bookworm; kept if present)
# Then: podman build --build-arg BASE=localhost/routing-replay-base:bookworm ... (docs/operating/docker.md).
set -euo pipefail
name="${1:-localhost/routing-replay-base:bookworm}"
if podman image exists "$name"; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$tmp/base.tar" \
  "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
podman import --quiet "$tmp/base.tar" "$name" >/dev/null
