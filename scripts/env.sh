# Sourced by serve.sh and test.sh: a project virtual environment in .venv with the given extras.
# torch is pinned to 2.13.0 (the CPU wheel these machines carry; vLLM's CPU build pins the same).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
stamp="$venv/.installed-$1-$(cat "$root/pyproject.toml" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$venv/bin/pip" install -q -e "$root[$1]"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
