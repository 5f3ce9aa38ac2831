"""vLLM's GPU releases (0.33, 0.34) for the tests: the environment `scripts/vllm_env.sh` makes, and running in it.

`.venv-vllm` holds torch 2.14.0 and what both releases need; each release is unpacked whole in
`.venv-vllm/vllm-<version>/`, chosen by PYTHONPATH. A test in the main environment runs a script there with
`run_script(version, path, ...)` or starts a process with `release_env(version)`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from capture.vllm.hook_points import GPU_WHEELS

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"


def release_dir(version: str) -> Path:
    """Where release `version`'s wheel is unpacked (its `vllm/` package inside)."""
    return VENV / f"vllm-{version}"


def require_release(version: str) -> Path:
    """The release's folder; the test skips (fails under REPLAY_REQUIRE_ALL) where scripts/vllm_env.sh has not run."""
    path = release_dir(version)
    if not (path / "vllm").is_dir() or not PYTHON.exists():
        msg = f"vLLM {version} is not unpacked in {path} (bash scripts/test.sh installs it)"
        if os.environ.get("REPLAY_REQUIRE_ALL") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def release_env(version: str, **extra: str) -> dict[str, str]:
    """The environment of a process that imports vLLM `version` (and this repository) from `.venv-vllm`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "ROUTING_REPLAY_"))}
    env.update(PYTHONPATH=f"{require_release(version)}{os.pathsep}{ROOT}", CUDA_VISIBLE_DEVICES="",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def run_script(version: str, script: Path | str, *args: str, timeout: float = 600,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `script` with vLLM `version`'s Python; its output is checked by the caller (returned, never raised)."""
    return subprocess.run([str(PYTHON), str(script), *args], env=env or release_env(version), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


__all__ = ["GPU_WHEELS", "PYTHON", "VENV", "release_dir", "release_env", "require_release", "run_script"]
