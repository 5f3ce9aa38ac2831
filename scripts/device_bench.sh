#!/usr/bin/env bash
# The many-core scaling run: bench/scaling.py (durable ingest and one step's fetch at 1, 2, 4, 8 and 16 service
# workers), made for the 16-core machine with an accelerator that some sessions are lent (x86-64, Python 3.12 as
# python3; numpy, pyarrow, numba and httpx there; no package registry).
# Needs there: the wheels of scripts/device_wheels.sh (run it here first), in the ignored folder .whl of the
# repository root, carried with the working tree. The device tool's call, from the repository root:
#   run(command="bash scripts/device_bench.sh", carry=[".whl"], timeout_s=600)
# then the table goes in the README's benchmark table with its date.
#   bash scripts/device_bench.sh [bench/scaling.py's options]    (e.g. --workers 1 2 4 --rounds 5)
#   PY=.venv/bin/python bash scripts/device_bench.sh --workers 1 2 --ingest-tokens 262144 --ranks 16 --sequences 32
#                                                                 (here, on 2 cores: a quick look, about 30 s)
# It installs the wheels (when .whl is there and the interpreter is Python 3.12, the wheels' tag) into SITE (default
# /tmp/site), puts the repository and SITE first on PYTHONPATH, and runs bench/scaling.py; with OUT set (the device
# tool's folder of files that come back) its output is also written to device_bench.txt there.
# Time at the defaults: about 4-6 minutes on 16 cores, estimated from runs on 2 cores here (1 worker at a quarter of
# the defaults: ingest part 5 s, step part 6 s, so ~35 s at full size; 1 and 2 workers at small sizes: a second
# service start adds 2-3 s) with the parts that do not shrink with workers (encoding bodies, ~6 s per count; storing
# the two steps through 4 clients in turn) counted at each count, and 16 workers' start-up on 16 cores. Each
# worker count's line is printed as soon as it is measured, so a run cut short at the tool's 10 minutes keeps its
# lines; where time is short, fewer counts (--workers 1 4 16) or --rounds 2.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PY:-python3}"
site="${SITE:-/tmp/site}"
if [ -d .whl ] && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "(no wheels installed: .whl missing or not Python 3.12; the interpreter's own packages are used)"
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$py" - <<'EOF'
import importlib.metadata as md
import sys

names = ["numpy", "pyarrow", "numba", "httpx", "fastapi", "uvicorn", "pydantic", "uvloop", "httptools"]
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} missing")
print(f"{sys.executable} {sys.version.split()[0]}: {', '.join(found)}")
EOF
if [ -n "${OUT:-}" ]; then
  "$py" bench/scaling.py "$@" 2>&1 | tee "$OUT/device_bench.txt"
else
  "$py" bench/scaling.py "$@"
fi
