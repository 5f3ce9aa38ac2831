#!/usr/bin/env bash
# GPU end-to-end check of the routing-replay vLLM plugin (scripts/gpu_check_vllm.py).
#
# Needs: one NVIDIA GPU (any with >= 8 GiB free; the model is tiny), a CUDA vLLM the plugin accepts
# (`pip install vllm==0.34.0`, or 0.33.0: the support matrix in docs/guides/vllm_plugin.md), and this project
# installed into the same environment so the entry point is registered:
#   pip install -e '.[test]'
# No network at run time (the model is built locally). ~2-4 minutes, two engine starts.
# It checks: the plugin's routes (vLLM's default runner, V2, with CUDA graphs: the graph-safe capture)
# == transformers float32 router top-k, row for row, layer by layer, no flags, positions complete; and with
# vLLM's own enable_return_routed_experts on, its routed_experts == the rows the plugin's tee stored == the
# plugin's routes == transformers.
# Usage: scripts/gpu_check_vllm.sh [python]   (default: python3 on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
"$PY" -c "from capture.vllm.hook_points import check_supported; print('vllm', check_supported())" \
  || { echo "gpu_check: this vLLM's hook points are not the plugin's (see the message above)" >&2; exit 3; }
"$PY" -c "from importlib.metadata import entry_points as e; assert any(x.name=='routing_replay' for x in e(group='vllm.general_plugins')), 'routing-replay not installed (pip install -e .)'"
exec "$PY" scripts/gpu_check_vllm.py
