"""The benchmarks page, docs/benchmarks.md, made from the benches' own output.

Most benches under bench/ end their output with a JSON line (bench/ray_step.py: one per run; a result may keep
several runs). A run saved by this script is a result file, docs/benchmarks/results/<bench>.json:

    {"date": "2026-12-05", "machine": {"cores": 2, "cpu": "AMD EPYC", "python": "3.11.7"},
     "command": "python bench/ingest.py --rounds 3", "output": <the bench's JSON line, or a list of them>}

and the page is one table per result file, made from those files (and the list of benches, for those not run),
every figure beside its same-run baseline as a ratio. Nobody edits the page: tests/test_bench_report.py makes it
again from the committed result files and fails where it differs.

    python scripts/bench_report.py run bench/ingest.py -- --rounds 3    # run it, save its result, make the page
    python scripts/bench_report.py run bench/ray_step.py --append -- --ranks 64   # add a run to its result
    python scripts/bench_report.py save bench/scaling.py device_bench.txt --command "bash scripts/device_bench.sh" \\
        --cores 16 --cpu "..." --python 3.12.3                           # keep a run made on another machine
    python scripts/bench_report.py page                                  # make the page from the result files
    python scripts/bench_report.py page --check                          # exit 1 if the page is not what they make
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BENCH = ROOT / "bench"
HELPERS = {"segment_files", "http_floor", "stopping", "service_cpu"}  # modules the benches share: nothing to run
NO_JSON = {"capture", "prefix_cache"}  # benches that print tables only, no JSON line to keep

Table = tuple[list[str], list[list[str]]]  # header, rows

HEADER = """# Benchmarks

Made by `python scripts/bench_report.py page` from the result files in `docs/benchmarks/results/`: each holds one
bench's own last JSON line(s), with the date, machine and command of its run. Do not edit this page;
`tests/test_bench_report.py` fails when it differs from what the script makes of the result files. To measure again,
`python scripts/bench_report.py run bench/<bench>.py -- <its options>` (CONTRIBUTING.md, "Benchmarks").

Every figure stands beside a baseline measured in the same run on the same machine (raw writes, the segment files
read directly, Ray's object store, an HTTP server that does nothing): compare ratios across machines and days, not
rates. Benches print medians of their rounds and assert nothing. The figures of earlier days, and what the unmet
targets need, are in the lab notebook: [benchmarks_history.md](benchmarks_history.md)."""


# ---------------------------------------------------------------- result files


def machine() -> dict[str, Any]:
    """This machine, as a result file names it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


def json_objects(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects a bench printed, in order: each starts a line with `{` (compact or indented)."""
    decoder, found, lines = json.JSONDecoder(), [], stdout.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    i = 0
    while i < len(lines):
        if lines[i].startswith("{"):
            try:
                value, end = decoder.raw_decode(stdout, offsets[i])
            except json.JSONDecodeError:
                value, end = None, offsets[i]
            if isinstance(value, dict) and not stdout[end:offsets[-1]].split("\n", 1)[0].strip():
                found.append(value)
                while i < len(lines) and offsets[i] < end:  # on past the object's lines
                    i += 1
                continue
        i += 1
    return found


def bench_script(bench: str) -> Path:
    script = (ROOT / bench).resolve()
    if script.parent != BENCH or not script.is_file():
        raise SystemExit(f"{bench}: not a bench under bench/")
    return script


def keep(name: str, found: list[dict[str, Any]], command: str, where: dict[str, Any], date: str,
         append: bool) -> Path:
    """Write the result file of bench `name` (adding to its runs with `append`), then make the page."""
    path = RESULTS / f"{name}.json"
    outputs: list[dict[str, Any]] = found if len(found) > 1 else []
    if append and path.is_file():
        before = json.loads(path.read_text())
        kept = before["output"] if isinstance(before["output"], list) else [before["output"]]
        outputs, command = [*kept, *found], f"{before['command']}; {command}"
    result = {"date": date, "machine": where, "command": command, "output": outputs if outputs else found[-1]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    PAGE.write_text(page())
    print(f"bench_report: saved {path}; made {PAGE}", file=sys.stderr)
    return path


def run(bench: str, args: list[str], append: bool) -> Path:
    """Run a bench (its output goes on to the terminal), keep its JSON line(s) as its result file, make the page."""
    script = bench_script(bench)
    command = " ".join(["python", f"bench/{script.name}", *map(shlex.quote, args)])
    print(f"bench_report: {command}", file=sys.stderr)
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line)
    if proc.wait() != 0:
        raise SystemExit(f"bench_report: {command} exited {proc.returncode}; nothing saved")
    found = json_objects("".join(out))
    if not found:
        raise SystemExit(f"bench_report: {command} printed no JSON line; nothing saved")
    return keep(script.stem, found, command, machine(), datetime.date.today().isoformat(), append)


def save(bench: str, output: Path, command: str, where: dict[str, Any], date: str, append: bool) -> Path:
    """Keep a run made elsewhere (a many-core machine's output file) as the bench's result file."""
    script = bench_script(bench)
    found = json_objects(output.read_text())
    if not found:
        raise SystemExit(f"bench_report: {output} holds no JSON line; nothing saved")
    return keep(script.stem, found, command, where, date, append)


def results(folder: Path | None = None) -> dict[str, dict[str, Any]]:
    """bench name -> its result file, in name order."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((folder or RESULTS).glob("*.json"))}


def runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    output = result["output"]
    return output if isinstance(output, list) else [output]


# ---------------------------------------------------------------- numbers


def millions(value: float) -> str:
    return f"{value / 1e6:.2f}"


def ratio(value: float | None) -> str:
    return "" if value is None else f"**{value:.2f}**"


def of(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


def per_gb(value: float | None, beside: float | None = None) -> str:
    """CPU-seconds per GB (bench/service_cpu.py), `beside` in brackets; "-" where a run made before them has none."""
    if value is None:
        return "-"
    return f"{value:.2f}" if beside is None else f"{value:.2f} ({beside:.2f})"


def cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, list):
        return ":".join(map(str, value)) if all(isinstance(v, int) for v in value) else json.dumps(value)
    return str(value).replace("|", "\\|")


def markdown(table: Table) -> str:
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- one table per bench


def ingest(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    out = result["output"]
    yield (f"Durable ingest (fsync) of 48 x top-8 uint8 rows through `POST /v1/ingest`, {out['workers']} service "
           "workers, beside the same batches written as Arrow IPC files and fsynced by one process (raw), and the "
           "same bodies sent to a server that drops them (the HTTP floor, and uvicorn with a bare app). M tokens/s; "
           "CPU per batch from `/proc`.")
    rows = []
    for name, f in out.items():
        if not isinstance(f, dict):
            continue
        rows.append([name, millions(f["ours_tokens_per_s"]), millions(f["raw_tokens_per_s"]), ratio(f["ratio"]),
                     f"{millions(f['floor_tokens_per_s'])} ({f['floor_ratio']:.2f})",
                     f"{millions(f['uvicorn_tokens_per_s'])} ({f['uvicorn_ratio']:.2f})",
                     f"{f['service_cpu_ms_per_batch']:.1f} / {f['writers_cpu_ms_per_batch']:.1f}",
                     f"{f['cpu_bound_ratio']:.2f}", f"{f['shared_vs_per_worker_table']:.2f}",
                     per_gb(f.get("service_cpu_s_per_gb"), f.get("raw_cpu_s_per_gb")),
                     per_gb(f.get("uvicorn_cpu_s_per_gb"))])
    yield markdown((["batches, writers", "ours", "raw", "ours / raw", "HTTP floor (/ raw)",
                     "uvicorn floor (/ raw)", "CPU ms per batch: service / writers",
                     "the ratio that CPU allows", "shared STALE table / per worker",
                     "service CPU-s per GB stored (raw write's)", "uvicorn floor's CPU-s per GB received"], rows))
    if "json_tokens_per_s" in out:
        yield (f"The same store fed int32 base64 in JSON per 1k-token request: {millions(out['json_tokens_per_s'])} "
               f"M tokens/s; Arrow (32768-row batches) / JSON: **{out['arrow_vs_json']:.1f}x**.")


def step_fetch(result: dict[str, Any], everything: dict[str, dict[str, Any]]) -> Iterator[str]:
    outs = runs(result)
    first = outs[0]
    yield (f"One training step, {first['sequences']} sequences x {first['tokens']} tokens ({first['step_mb']} MB of "
           "routes), THD with TP 2 x CP 2: the ranks, each its own process, ask `megatron_batch` for their slices at "
           "once; first = right after ingest (the ranks fetched the previous step before), warm = medians of the "
           "rounds after, fresh = rank processes that fetch nothing before. Baselines of the same run: one client "
           "fetching the same slices in turn, one process reading the rows from the page-cached segment files, "
           "vLLM's in-band answers decoded by one process. `sink`: rows as the plugin's sink ships them "
           "(4 writers); `kind`: 8 whole requests per batch. M rows/s. The read path alone: the service's "
           "`read_slice` over the same data in the bench's own process, one slice after another, no HTTP (a store "
           "opened fresh, then again): its CPU per GB without the noise of 16 ranks and 2 workers sharing 2 cores.")
    ray = {(r["ranks"], r["sequences"], r["tokens"]): r for r in runs(everything.get("ray_step", {"output": []}))}
    rows = []
    for out in outs:
        band = out["in_band_rows_per_s"]
        for key, f in out.items():
            if not isinstance(f, dict):
                continue
            shape, ranks = key.rsplit("_r", 1)
            theirs = ray.get((int(ranks), out["sequences"], out["tokens"]))
            rows.append([out["convention"], f"{shape} ({f['segments']})", ranks, millions(f["cold_rows_per_s"]),
                         millions(f["warm_rows_per_s"]), millions(f["fresh_rows_per_s"]),
                         ratio(f["cold_over_warm"]),
                         f"{millions(f['cold_turn_rows_per_s'])} / {millions(f['warm_turn_rows_per_s'])}",
                         f"{ratio(f['cold_vs_turn'])} / {f['warm_vs_turn']:.2f}",
                         f"{millions(f['files_rows_per_s'])}", f"{f['cold_vs_files']:.2f} / {f['warm_vs_files']:.2f}",
                         f"{millions(band)}", f"{f['cold_rows_per_s'] / band:.1f}",
                         "" if theirs is None else ratio(of(f["cold_rows_per_s"], theirs["first_rows_per_s"])),
                         ":".join(map(str, f["split"])),
                         " / ".join(per_gb(f.get(k)) for k in ("cold_cpu_s_per_gb", "warm_cpu_s_per_gb",
                                                             "fresh_cpu_s_per_gb"))
                         + f" ({per_gb(f.get('files_cpu_s_per_gb'))})",
                         " / ".join(per_gb(f.get(k)) for k in ("read_path_first_cpu_s_per_gb",
                                                             "read_path_warm_cpu_s_per_gb"))])
    yield markdown((["THD rule", "shape (segments)", "ranks", "first", "warm", "fresh", "first / warm",
                     "one client in turn: first / warm", "at once / in turn: first / warm", "memory read",
                     "of the memory read: first / warm", "in-band", "first / in-band",
                     "first / Ray's first (ray_step)", "connections per worker",
                     "service CPU-s per GB delivered: first / warm / fresh (memory read's)",
                     "the read path alone, one process: first / warm"], rows))


def ray_step(result: dict[str, Any], everything: dict[str, dict[str, Any]]) -> Iterator[str]:
    yield ("One training step through Ray's object store, as RL frameworks move routes: two raylets on this "
           "machine, a rollout actor `ray.put`s each request's rows, the rank actors (TP 2 x CP 2) `ray.get` their "
           "DP group's and cut their share; fresh = actors that fetched nothing before, first = after the previous "
           "step, warm = medians of the rounds after. The baseline the service's step fetch (bench/step_fetch.py, "
           "`sink` shape, same grid) is set beside. M rows/s.")
    service = {}
    for out in runs(everything.get("step_fetch", {"output": []})):
        if out["convention"] == "megatron":
            for key, f in out.items():
                if key.startswith("sink_r"):
                    service[(int(key[6:]), out["sequences"], out["tokens"])] = f
    rows = []
    for out in runs(result):
        row = [str(out["ranks"]), f"{out['sequences']} x {out['tokens']}", millions(out["fresh_rows_per_s"]),
               millions(out["first_rows_per_s"]), millions(out["warm_rows_per_s"])]
        ours = service.get((out["ranks"], out["sequences"], out["tokens"]))
        if ours is None:
            row += ["", "", ""]
        else:
            row += [f"{millions(ours['cold_rows_per_s'])} / {millions(ours['warm_rows_per_s'])}",
                    ratio(of(ours["cold_rows_per_s"], out["first_rows_per_s"])),
                    f"{ours['warm_rows_per_s'] / out['warm_rows_per_s']:.2f}"]
        rows.append(row)
    yield markdown((["ranks", "step", "Ray fresh", "Ray first", "Ray warm", "service first / warm",
                     "service / Ray, first", "service / Ray, warm"], rows))


STAGES = ("decode", "check", "duplicate lookup", "STALE check", "segment", "commit")


def ingest_stages(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    per = result["output"]["ns_per_row"]
    yield ("CPU of each ingest stage in one thread, no HTTP, fsync on (`time.thread_time`: waits on the disk not "
           "counted), ns per row, medians over every batch; beside them the check's compiled kernel alone and its "
           "two parts every row needs. The ratio is the stage's share of the stages' total.")
    sizes = list(per)
    totals = {size: sum(per[size][s] for s in STAGES if s in per[size]) for size in sizes}
    names = list(dict.fromkeys(name for size in sizes for name in per[size]))
    rows = []
    for name in names:
        row = [name if name in STAGES else f"({name})"]
        for size in sizes:
            value = per[size].get(name)
            row += ["", ""] if value is None else [f"{value:.0f}", ratio(of(value, totals[size]))]
        rows.append(row)
    rows.append(["total of the stages", *[x for size in sizes for x in
                                          (f"{totals[size]:.0f} ({totals[size] * int(size) / 1e6:.2f} ms a batch)",
                                           ratio(1.0))]])
    yield markdown((["stage", *[x for size in sizes for x in (f"{size} rows: ns/row", "share")]], rows))
    parts = result["output"].get("split")
    if parts:
        yield ("Each stage's CPU split into what a batch costs whatever its rows and what each row adds, a "
               "least-squares line through the sizes' medians: larger batches amortise the first, no batch size the "
               "second.")
        batch = sum(parts[s]["per_batch_ms"] for s in STAGES)
        row = sum(parts[s]["per_row_ns"] for s in STAGES)
        split_rows = [[name if name in STAGES else f"({name})", f"{part['per_batch_ms']:.2f}",
                       f"{part['per_row_ns']:.0f}"] for name, part in parts.items()]
        split_rows.append(["total of the stages", f"{batch:.2f}",
                           f"{row:.0f} ({row / result['output']['row_bytes']:.2f} CPU-s per GB of rows)"])
        yield markdown((["stage", "ms a batch", "ns a row"], split_rows))


def rows_per_s(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    """bench/route_get.py and bench/fetch.py: rows/s per path, beside the rows read straight from the files."""
    out, base_name = result["output"], "direct segment files, one process"
    base = out.get(base_name)
    yield (f"Each path's rows per second (M rows/s, medians of the rounds), beside the same rows read by one process "
           f"straight from the segment files (`{base_name}`), the baseline; 1-min load {out.get('load_1min', '?')}.")
    rows = [[name, millions(value), "" if name == base_name else ratio(of(value, base))]
            for name, value in out.items() if isinstance(value, (int, float)) and name != "load_1min"]
    yield markdown((["path", "M rows/s", "of the files"], rows))
    served = out.get("server_us")
    if served:
        yield ("The service's own time per GET, in process (ASGI, no socket), us: as served, the same endpoint "
               "declared parameter by parameter (before), and the read and encoding alone.")
        yield markdown((["answer", "as served", "declared (before)", "work alone", "served / declared",
                         "HTTP layer: served / declared"],
                        [[name, str(us["served"]), str(us["declared"]), str(us["direct"]),
                          ratio(of(us["served"], us["declared"])),
                          f"{us['served'] - us['direct']} / {us['declared'] - us['direct']}"]
                         for name, us in served.items()]))


def compression(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    out = result["output"]
    sets = {name: f for name, f in out.items() if isinstance(f, dict)}
    yield (f"Segment files of {next(iter(sets.values()))['rows']} rows (48 x top-8 of 128 experts) through each "
           "Arrow IPC buffer codec `REPLAY_SEGMENT_COMPRESSION` selects (and zstd level 3, and the ids by layer of "
           "segment 3.0), beside the uncompressed file of the same run: bytes per id and MB/s of id bytes, medians "
           f"of {out['rounds']} rounds; 1-min load {out['load']}.")
    rows = []
    for name, f in sets.items():
        for codec, c in f["ipc"].items():
            rows.append([name, codec, f"{c['bytes_per_id']:.3f}",
                         f"{c['bytes_per_id'] / f['ipc']['none']['bytes_per_id']:.2f}", f"{c['write_mb_s']:.0f}",
                         f"{c['read_mb_s']:.0f}", ratio(c["read_vs_none"])])
    yield markdown((["data", "codec", "bytes per id", "of none", "write MB/s", "read MB/s", "read / none"], rows))
    yield ("The ids alone under other codings (zstd level 3 after the transform), beside the ids alone under plain "
           "zstd (`ids+zstd3`); a lossy coding loses the order of a layer's ids.")
    rows = []
    for name, f in sets.items():
        base = f["sets"].get("ids+zstd3", {}).get("bytes_per_id")
        for coding, c in f["sets"].items():
            rows.append([name, coding, f"{c['bytes_per_id']:.3f}", ratio(of(c["bytes_per_id"], base)),
                         "yes" if c["lossless"] else "no", f"{c['codec_mb_s']:.0f}"])
    yield markdown((["data", "coding", "bytes per id", "of ids+zstd3", "lossless", "encode + decode MB/s"], rows))


def health_cardinality(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    out = result["output"]
    base = next((r for r in out["results"] if r["cap"] == 0), None)
    yield (f"`/metrics` of a service holding {out['results'][0]['runs']} runs (stored in {out['fill_s']} s), "
           "scraped with run health exported for the newest `REPLAY_METRICS_MAX_RUNS` runs only, beside the "
           "scrape with none exported (cap 0); scrape times are medians (min-max).")
    rows = [[str(r["cap"]), f"{r['series']:,}", f"{r['per_run_series']:,}", str(r["exported_runs"]),
             f"{r['bytes']:,}", f"{r['scrape_ms_median']:.1f} ({r['scrape_ms_min']:.1f}-{r['scrape_ms_max']:.1f})",
             "" if base is None else ratio(of(r["scrape_ms_median"], base["scrape_ms_median"]))]
            for r in out["results"]]
    yield markdown((["cap", "series", "per-run series", "runs exported", "bytes", "scrape ms",
                     "scrape / cap 0"], rows))


def scaling(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    out = result["output"]
    rows_in = out["rows"]
    yield (f"The service at each worker count, one after another on this machine (1-min load {out.get('load_1min')}):"
           f" durable ingest of {out['ingest_tokens']:,} tokens per round in 8192-row batches, and one step of "
           f"{out['sequences']} x {out['tokens']} tokens fetched by {out['ranks']} ranks at once (TP 2 x CP 2, THD; "
           "first after the step before, then warm); medians of "
           f"{out['rounds']} rounds. The baseline is the first worker count's, in the same run.")
    if not rows_in:
        return
    base = rows_in[0]
    rows = [[str(r["workers"]), str(r["writers"]), millions(r["ingest_tokens_per_s"]),
             ratio(of(r["ingest_tokens_per_s"], base["ingest_tokens_per_s"])),
             f"{r['service_cpu_ms_per_batch']:.1f} / {r['writers_cpu_ms_per_batch']:.1f}",
             millions(r["step_first_rows_per_s"]), ratio(of(r["step_first_rows_per_s"], base["step_first_rows_per_s"])),
             millions(r["step_warm_rows_per_s"]), ratio(of(r["step_warm_rows_per_s"], base["step_warm_rows_per_s"])),
             ":".join(map(str, r["connections_per_worker"])),
             " / ".join(per_gb(r.get(k)) for k in ("ingest_cpu_s_per_gb", "first_cpu_s_per_gb", "warm_cpu_s_per_gb"))]
            for r in rows_in]
    yield markdown((["workers", "writers", "ingest M tokens/s", f"x of {base['workers']}",
                     "CPU ms per batch: service / writers", "step first M rows/s", f"x of {base['workers']}",
                     "step warm M rows/s", f"x of {base['workers']}", "connections per worker",
                     "service CPU-s per GB: ingest / first / warm"], rows))


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from flat(inner, f"{prefix} / {key}" if prefix else str(key))
    else:
        yield prefix, value


def generic(result: dict[str, Any], _: dict[str, dict[str, Any]]) -> Iterator[str]:
    """A bench without a table of its own here: its JSON, key by key (ratios are the bench's own)."""
    for i, out in enumerate(runs(result)):
        if len(runs(result)) > 1:
            yield f"Run {i + 1}:"
        yield markdown((["figure", "value"], [[cell(k), cell(v)] for k, v in flat(out)]))


TABLES: dict[str, Callable[[dict[str, Any], dict[str, dict[str, Any]]], Iterator[str]]] = {
    "ingest": ingest, "ingest_stages": ingest_stages, "step_fetch": step_fetch, "ray_step": ray_step,
    "route_get": rows_per_s, "fetch": rows_per_s, "compression": compression,
    "health_cardinality": health_cardinality, "scaling": scaling,
}


def section(bench: str, result: dict[str, Any], everything: dict[str, dict[str, Any]]) -> str:
    m = result["machine"]
    parts = [f"## bench/{bench}.py",
             f"Run {result['date']} on {m['cores']} cores ({m['cpu']}), Python {m['python']}: "
             f"`{result['command']}`."]
    parts += TABLES.get(bench, generic)(result, everything)
    return "\n\n".join(parts)


def page(folder: Path | None = None, bench_folder: Path = BENCH) -> str:
    """docs/benchmarks.md, made from the result files in `folder` (default RESULTS)."""
    everything = results(folder)
    benches = sorted(p.stem for p in bench_folder.glob("*.py")) if bench_folder.is_dir() else []
    missing = [b for b in benches if b not in everything and b not in HELPERS | NO_JSON]
    parts = [HEADER]
    if missing:
        parts.append("No result on the current code yet (run them as above): "
                     + ", ".join(f"`bench/{b}.py`" for b in missing) + ". "
                     "Their last figures are in the lab notebook.")
    quiet = [b for b in benches if b in NO_JSON]
    if quiet:
        parts.append(", ".join(f"`bench/{b}.py`" for b in quiet) + " print tables only, no JSON line to keep: "
                     "their figures are in the lab notebook.")
    parts += [section(bench, result, everything) for bench, result in everything.items()]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    runner = sub.add_parser("run", help="run a bench, save its result file, make the page")
    runner.add_argument("bench", help="bench/<name>.py")
    runner.add_argument("--append", action="store_true", help="add this run's JSON to the result file's")
    runner.add_argument("args", nargs=argparse.REMAINDER, help="-- then the bench's own options")
    saver = sub.add_parser("save", help="keep a run made elsewhere (its printed output in a file), make the page")
    saver.add_argument("bench", help="bench/<name>.py")
    saver.add_argument("output", type=Path, help="what the bench printed (its JSON line(s) at the end)")
    saver.add_argument("--command", required=True, help="the command that ran it, as written in the result")
    saver.add_argument("--date", help="the run's (default: as its JSON says, else today)")
    saver.add_argument("--cores", type=int, help="the machine's (default: this machine's)")
    saver.add_argument("--cpu", help="the machine's CPU model (default: this machine's)")
    saver.add_argument("--python", help="the Python version it ran with (default: this one)")
    saver.add_argument("--append", action="store_true", help="add this run's JSON to the result file's")
    maker = sub.add_parser("page", help="make docs/benchmarks.md from the result files")
    maker.add_argument("--check", action="store_true", help="only compare: exit 1 if the page differs")
    args = parser.parse_args(argv)
    if args.mode == "run":
        run(args.bench, args.args[1:] if args.args[:1] == ["--"] else args.args, args.append)
        return 0
    if args.mode == "save":  # the machine: as given, else as the bench's JSON says (bench/scaling.py), else this one
        said = (json_objects(args.output.read_text()) or [{}])[-1]
        here = {**machine(), **{k: said[k] for k in ("cores", "cpu", "python") if k in said}}
        where = {"cores": args.cores or here["cores"], "cpu": args.cpu or here["cpu"],
                 "python": args.python or here["python"]}
        date = args.date or str(said.get("date", datetime.date.today().isoformat()))[:10]
        save(args.bench, args.output, args.command, where, date, args.append)
        return 0
    made = page()
    if args.check:
        if PAGE.is_file() and PAGE.read_text() == made:
            return 0
        print(f"{PAGE} is not what the result files make: python scripts/bench_report.py page", file=sys.stderr)
        return 1
    PAGE.write_text(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
