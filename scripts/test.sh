#!/usr/bin/env bash
# The test suite.
#
#   bash scripts/test.sh            install everything (scripts/install.sh), lint, then every CPU test (what CI runs)
#   bash scripts/test.sh --fast     in the active environment, no install: lint and the tests not marked slow
#                                   (a few minutes on 2 cores; every module is imported and most are exercised)
#
# GPU tests are marked `gpu` and skipped on machines without one; further arguments go to pytest.
# ASYNCRL_TEST_WORKERS=N runs the tests on N pytest-xdist workers (default 0: one after another). On 2 cores
# it gains nothing: a run under test keeps both busy, and its timing-sensitive checks get tighter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
fast=0
if [ "${1:-}" = --fast ]; then
  fast=1
  shift
fi
[ "$fast" = 1 ] || bash scripts/install.sh
export DS_ACCELERATOR=cpu
"$PY" -m ruff check .
"$PY" -m ruff format --check .
workers=(-n "${ASYNCRL_TEST_WORKERS:-0}" --dist loadgroup)
if [ "$fast" = 1 ]; then
  exec "$PY" -m pytest -m "not gpu and not slow" -q --durations=10 "${workers[@]}" "$@"
fi
exec "$PY" -m pytest -m "not gpu" -q --durations=25 "${workers[@]}" "$@"
