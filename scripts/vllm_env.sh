# Sourced by env.sh (test): the environment the plugin is checked in against vLLM's GPU releases (0.33, 0.34).
#
# vLLM 0.33 and 0.34 ship only CUDA wheels; they import without a GPU, and their engine core, scheduler and
# connectors are plain Python. One venv, .venv-vllm, holds what both pin (torch==2.14.0, the CUDA build from
# PyPI), their Python requirements less the GPU kernel packages no CPU test imports, and the project itself
# (editable, so vLLM finds the plugin's entry point). Each release's own wheel is unpacked beside it, whole,
# in .venv-vllm/vllm-<version>/ (pip --target, no deps): a test picks one with PYTHONPATH
# (tests/support/vllm_releases.py), and the hook-point check reads its sources (capture/vllm/hook_points.py).
# The releases are listed once, in capture/vllm/hook_points.py (SUPPORTED); adding one is a line there.
# Cost on a fresh machine (2026-12-04): ~3.3 GB downloaded, ~2 min here.
set -euo pipefail
vvenv="$root/.venv-vllm"
releases=$("$venv/bin/python" -c 'import sys; sys.path.insert(0, sys.argv[1])
from capture.vllm.hook_points import GPU_WHEELS
print(" ".join(GPU_WHEELS))' "$root")
vstamp="$vvenv/.installed-$( (cat "$root/scripts/vllm_env.sh"; echo "$releases") | sha1sum | cut -c1-12)"
if [ ! -f "$vstamp" ]; then
  [ -x "$vvenv/bin/python" ] || python3 -m venv "$vvenv"
  "$vvenv/bin/pip" install -q --upgrade pip
  wheels="$vvenv/wheels"
  mkdir -p "$wheels"
  reqs=()
  for v in $releases; do
    ls "$wheels"/vllm-"$v"-*.whl >/dev/null 2>&1 || "$vvenv/bin/pip" download -q --no-deps "vllm==$v" -d "$wheels"
    # vLLM's own requirements, less the GPU kernels and media codecs nothing here imports
    "$venv/bin/python" - "$wheels"/vllm-"$v"-*.whl "$v" > "$wheels/requirements-$v.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
GPU_ONLY = {"torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi",
            "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl",
            "quack-kernels", "tokenspeed-mla", "humming-kernels"}
wheel, version = sys.argv[1], sys.argv[2]
for line in zipfile.ZipFile(wheel).read(f"vllm-{version}.dist-info/METADATA").decode().splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if (req.marker is None or req.marker.evaluate({"extra": ""})) and \
                req.name.lower().replace("_", "-") not in GPU_ONLY:
            print(req)
EOF
    reqs+=(-r "$wheels/requirements-$v.txt")
  done
  "$vvenv/bin/pip" install -q "${reqs[@]}" pytest
  "$vvenv/bin/pip" install -q -e "$root"  # the plugin's entry point, and the base dependencies (numpy, pyarrow, httpx)
  for v in $releases; do
    rm -rf "$vvenv/vllm-$v"
    "$vvenv/bin/pip" install -q --no-deps --target "$vvenv/vllm-$v" "$wheels"/vllm-"$v"-*.whl
  done
  rm -rf "$wheels"
  touch "$vstamp"
fi
