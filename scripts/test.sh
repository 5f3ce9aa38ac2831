#!/usr/bin/env bash
# Install everything the tests need into .venv, then run the whole suite.
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --fast     the fast loop: no vLLM engine, no browser, no kill/restart rounds (`-m "not slow"`)
# Other arguments go to pytest (e.g. -k flags, -x, a test file).
if [ "${1:-}" = "--fast" ]; then export REPLAY_FAST_LOOP=1; fi  # env.sh leaves out what only slow tests need
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
cd "$root"
export REPLAY_REQUIRE_ALL=1  # a test that would skip for a missing package or browser fails instead
# Keep compiled modules (__pycache__, git-ignored) even where the shell says not to: the suite starts ~100 service
# and engine processes, and each would compile the project again; the fast loop also keeps pytest's rewritten
# test modules (54 s -> 45 s here).
unset PYTHONDONTWRITEBYTECODE
# Both run two test files at a time (pytest-xdist; a file's tests in one worker, so a module's engines and services
# start once): a one-at-a-time run waits ~45% of its time on processes starting, stopping and answering (2026-12-06,
# 2 cores: the whole suite 26:00 one at a time, 14:34 two at a time; the fast loop 67 s, 40 s). REPLAY_TEST_WORKERS=0:
# one at a time, in this process.
if [ "${1:-}" = "--fast" ]; then
  shift
  # schemathesis' and hypothesis' pytest plugins cost ~2 s of imports; only the (slow) API fuzz test uses them
  exec python -m pytest -q -p no:cacheprovider -p no:schemathesis -p no:hypothesispytest -m "not slow" \
    -n "${REPLAY_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
fi
exec python -m pytest -q -p no:cacheprovider -n "${REPLAY_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=25 "$@"
