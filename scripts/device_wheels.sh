#!/usr/bin/env bash
# The wheels that scripts/device_bench.sh carries to the machine with an accelerator that some sessions are lent
# (x86-64, Python 3.12 as python3, 16 cores, no package registry): what the service, the step fetch's client and
# bench/scaling.py import there that the machine lacks, downloaded into the ignored folder .whl in the repository
# root, one wheel per package, at the versions of .venv (bash scripts/env.sh service or test makes it).
#   bash scripts/device_wheels.sh        a new .whl folder; prints each wheel, the total, and the tree + wheels size
# The machine has numpy, pyarrow, numba (with llvmlite) and httpx. The first three are not carried; the rest is,
# httpx (with httpcore, certifi) too, as is what that image happens to hold (anyio, click, uvloop, ...): the wheels
# go first on PYTHONPATH there, so the service and its client run on the versions tested here (an older httpcore
# there beside a newer h11 is not a pair anyone tested). Not carried: typer's rich (with markdown-it-py, mdurl, pygments:
# imported only by `replay-service reindex`'s progress bar; typer's help falls back to click's without it), psycopg
# (only with a PostgreSQL index), and the optional imports that fail quietly (orjson, python-multipart, websockets,
# watchfiles, sniffio, pybase64, brotli). Checked with Python 3.12 here: the bench ran on these wheels alone beside
# numpy, pyarrow, numba and llvmlite.
# A package's Requires-Dist that is neither carried nor on the machine is printed as MISSING (exit 1). What travels
# (tracked and untracked-not-ignored files plus carried paths) must stay under 64 MiB; the script prints both sizes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PY:-$root/.venv/bin/python}"
# Imported on the bench's path (ServiceProcess runs `python -m replay_service.ops.cli serve`: typer, uvicorn with
# httptools and uvloop, FastAPI, pydantic-settings, the checks' CRC32C, Prometheus metrics), with what those need.
packages=(
  fastapi starlette annotated-doc pydantic pydantic-core pydantic-settings python-dotenv annotated-types
  typing-extensions typing-inspection
  uvicorn httptools uvloop h11 click anyio idna
  httpx httpcore certifi
  prometheus-client crc32c
  typer shellingham
)
on_device=(numpy pyarrow numba llvmlite)  # there already (numba's llvmlite with it); never carried
not_needed=(rich markdown-it-py mdurl pygments)  # required by typer's metadata, never imported on the bench's path

pins=$("$py" - "${packages[@]}" <<'EOF'
import importlib.metadata as md
import sys
for name in sys.argv[1:]:
    print(f"{name}=={md.version(name)}")
EOF
)
rm -rf .whl
mkdir -p .whl
for pin in $pins; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$pin"
done
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude

"$py" - "${on_device[@]}" "${not_needed[@]}" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
wheels = sorted(Path(".whl").glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
present = carried | {norm(n) for n in sys.argv[1:]}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if (req.marker is None or Marker(str(req.marker)).evaluate(env)) and norm(req.name) not in present:
                missing.append(f"{wheel.name}: {req}")
    print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
total = sum(w.stat().st_size for w in wheels)
print(f"  {total / 2**20:6.2f} MiB  in {len(wheels)} wheels (.whl)")
for m in missing:
    print(f"MISSING {m}")
sys.exit(1 if missing else 0)
EOF
"$py" - <<'EOF'
import subprocess
from pathlib import Path

listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], check=True,
                        capture_output=True).stdout.decode().split("\0")
tree = sum(Path(p).lstat().st_size for p in listed if p and Path(p).is_file())
wheels = sum(w.stat().st_size for w in Path(".whl").glob("*.whl"))
print(f"  {tree / 2**20:.1f} MiB working tree (tracked + untracked-not-ignored) + {wheels / 2**20:.1f} MiB wheels = "
      f"{(tree + wheels) / 2**20:.1f} MiB of the 64 MiB that may travel")
if tree + wheels >= 64 * 2**20:
    raise SystemExit("over the 64 MiB limit")
EOF
