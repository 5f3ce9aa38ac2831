#!/usr/bin/env bash
# The images the container tests run, made where no image registry is reachable:
# - the Debian base (scripts/container_base.sh; kept once made);
# - on it, the service's image from this checkout (Dockerfile), localhost/routing-replay:latest;
# - the scale-out profile's stand-ins from deploy/podman/images/ (PostgreSQL, nginx, moto's S3 server), tagged
#   localhost/routing-replay-{postgres,nginx,s3}:bookworm (deploy/podman/scale-out.yml).
# podman's layer cache keeps what did not change: nothing changed, seconds; the code changed, ~10 s.
#   bash scripts/container_images.sh     (scripts/env.sh at install, tests/test_container.py; CONTAINERS_CONF as there)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base=localhost/routing-replay-base:bookworm
bash "$root/scripts/container_base.sh" "$base"
ca=/etc/ssl/certs/ca-certificates.crt  # a TLS-intercepting proxy's CA, when the host trusts one (pip in the build)
secret=()
if [ -f "$ca" ]; then secret=(--secret "id=pip-ca,src=$ca"); fi
build() {  # tag, context
  podman build --quiet --format docker --build-arg "BASE=$base" "${secret[@]}" -t "$1" "$2" >/dev/null
}
build localhost/routing-replay:latest "$root"
for part in postgres nginx s3; do
  build "localhost/routing-replay-$part:bookworm" "$root/deploy/podman/images/$part"
done
