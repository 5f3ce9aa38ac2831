"""docs/benchmarks.md is what scripts/bench_report.py makes of the committed result files (a hand edit fails here),
and a result renders without running any bench."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("bench_report", ROOT / "scripts" / "bench_report.py")
assert SPEC is not None and SPEC.loader is not None
report = importlib.util.module_from_spec(SPEC)
sys.modules["bench_report"] = report
SPEC.loader.exec_module(report)

MACHINE = {"cores": 16, "cpu": "Test CPU", "python": "3.11.7"}


def write(folder: Path, name: str, command: str, output: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"date": "2026-01-02", "machine": MACHINE, "command": command,
                                                     "output": output}))


def test_the_committed_page_is_what_the_result_files_make():
    made = report.page()
    assert report.PAGE.read_text() == made, "docs/benchmarks.md is made: python scripts/bench_report.py page"


# benches whose runs are kept through a script of their own (scripts/device_bench.sh runs bench/scaling.py on the
# lent many-core machine)
WRAPPED = {"scaling": "bash scripts/device_bench.sh"}


def test_every_result_file_says_when_where_and_how():
    found = report.results()
    assert found, "no result files under docs/benchmarks/results/"
    for name, result in found.items():
        assert (report.BENCH / f"{name}.py").is_file(), name
        assert set(result) == {"date", "machine", "command", "output"}, name
        assert set(result["machine"]) == {"cores", "cpu", "python"}, name
        assert result["command"].startswith(WRAPPED.get(name, f"python bench/{name}.py")), name
        assert report.runs(result) and all(isinstance(r, dict) for r in report.runs(result)), name


def test_a_synthetic_result_renders(tmp_path):
    results, benches = tmp_path / "results", tmp_path / "bench"
    benches.mkdir()
    for name in ("ray_step", "tiny", "unmeasured", "capture"):
        (benches / f"{name}.py").write_text('"""A bench."""\n')
    write(results, "ray_step", "python bench/ray_step.py --ranks 16",
          [{"ranks": 16, "sequences": 8, "tokens": 16, "fresh_rows_per_s": 1_000_000, "first_rows_per_s": 2_000_000,
            "warm_rows_per_s": 4_000_000}])
    write(results, "tiny", "python bench/tiny.py --rounds 1",
          {"ours_rows_per_s": 500_000, "raw_rows_per_s": 1_000_000, "ratio": 0.5, "parts": {"a": 1.25, "b": [1, 2]}})
    made = report.page(results, benches)
    assert "## bench/ray_step.py" in made and "## bench/tiny.py" in made
    assert "Run 2026-01-02 on 16 cores (Test CPU), Python 3.11.7: `python bench/tiny.py --rounds 1`." in made
    assert "| 16 | 8 x 16 | 1.00 | 2.00 | 4.00 |" in made  # M rows/s
    assert "| ratio | 0.5 |" in made and "| parts / a | 1.25 |" in made and "| parts / b | 1:2 |" in made
    assert "`bench/unmeasured.py`" in made and "`bench/capture.py` print tables only" in made
    assert report.page(results, benches) == made  # the same files make the same page


def test_the_json_lines_a_bench_printed_are_found():
    out = 'a table\n{"x": 1}\nnot {json}\n{"y": [1,\n 2]}\n{"z": 1} and more\n{"w": 2}\n'
    assert report.json_objects(out) == [{"x": 1}, {"y": [1, 2]}, {"w": 2}]
    assert report.json_objects("no json here\n") == []


def test_a_run_made_on_another_machine_is_kept_with_that_machine(tmp_path, monkeypatch):
    """`save`: bench/scaling.py's output from a many-core machine, its date and machine taken from its JSON."""
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(report, "PAGE", tmp_path / "benchmarks.md")
    row = {"writers": 4, "service_cpu_ms_per_batch": 10.0, "writers_cpu_ms_per_batch": 3.0,
           "connections_per_worker": [2, 2], "seconds": [1.0]}
    line = {"date": "2026-12-06 10:00 UTC", "cores": 16, "cpu": "Big CPU", "python": "3.12.3", "load_1min": 0.5,
            "ingest_tokens": 1024, "ranks": 64, "sequences": 256, "tokens": 2048, "rounds": 3,
            "rows": [{**row, "workers": 1, "ingest_tokens_per_s": 1_000_000, "step_first_rows_per_s": 2_000_000,
                      "step_warm_rows_per_s": 3_000_000},
                     {**row, "workers": 4, "ingest_tokens_per_s": 3_000_000, "step_first_rows_per_s": 5_000_000,
                      "step_warm_rows_per_s": 9_000_000}]}
    printed = tmp_path / "device_bench.txt"
    printed.write_text("a header\n  a table line\n" + json.dumps(line) + "\n")
    assert report.main(["save", "bench/scaling.py", str(printed), "--command", "bash scripts/device_bench.sh"]) == 0
    kept = json.loads((tmp_path / "results" / "scaling.json").read_text())
    assert kept["date"] == "2026-12-06" and kept["machine"] == {"cores": 16, "cpu": "Big CPU", "python": "3.12.3"}
    made = (tmp_path / "benchmarks.md").read_text()
    assert "Run 2026-12-06 on 16 cores (Big CPU), Python 3.12.3: `bash scripts/device_bench.sh`." in made
    assert "| 4 | 4 | 3.00 | **3.00** | 10.0 / 3.0 | 5.00 | **2.50** | 9.00 | **3.00** | 2:2 |" in made
