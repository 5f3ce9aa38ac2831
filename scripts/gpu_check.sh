#!/usr/bin/env bash
# Device check of the graph-safe capture inside a real torch.cuda.CUDAGraph (scripts/gpu_check.py).
#
# Needs: one NVIDIA GPU and a CUDA build of PyTorch (+ numpy). No vLLM, no network, nothing
# installed from this repo: it imports capture/worker/graph_recorder.py and replay_format from
# the checkout. Seconds; well under 5 minutes. Exit 0 and a last line `gpu_check: PASS` when
# every row and stamp of every replayed step equals the eager reference.
# Usage: scripts/gpu_check.sh [python] [gpu_check.py args, e.g. --device cpu]
# The vLLM end-to-end GPU check (needs CUDA vLLM 0.33) is scripts/gpu_check_vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
shift || true
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/gpu_check.py "$@"
