#!/usr/bin/env bash
# Install everything the tests need into .venv, then run the whole suite.
# Extra arguments go to pytest (e.g. -k flags, -x).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
cd "$root"
export REPLAY_REQUIRE_ALL=1  # a test that would skip for a missing package or browser fails instead
exec python -m pytest -q -p no:cacheprovider "$@"
