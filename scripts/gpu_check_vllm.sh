#!/usr/bin/env bash
# GPU end-to-end check of the routing-replay vLLM plugin (scripts/gpu_check_vllm.py).
#
# Needs: one NVIDIA GPU (any with >= 8 GiB free; the model is tiny), CUDA vLLM 0.33.x
# (`pip install vllm==0.33.0`, which brings its CUDA torch and transformers), and this
# project installed into the same environment so the entry point is registered:
#   pip install -e '.[test]'
# No network at run time (the model is built locally). ~2-4 minutes, two engine starts.
# It checks: plugin routes (V1 runner) == transformers float32 router top-k, row for row,
# layer by layer, no flags, positions complete; and vLLM's own routed_experts (V2 runner,
# enable_return_routed_experts) == the plugin's routes == transformers.
# Usage: scripts/gpu_check_vllm.sh [python]   (default: python3 on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
"$PY" -c "import vllm, sys; print('vllm', vllm.__version__); sys.exit(0 if vllm.__version__.startswith('0.33') else 3)" \
  || { echo "gpu_check: needs vLLM 0.33.x" >&2; exit 3; }
"$PY" -c "from importlib.metadata import entry_points as e; assert any(x.name=='routing_replay' for x in e(group='vllm.general_plugins')), 'routing-replay not installed (pip install -e .)'"
exec "$PY" scripts/gpu_check_vllm.py
