#!/usr/bin/env bash
# The test suite.
#
#   bash scripts/test.sh            install everything (scripts/install.sh), lint, then every CPU test (what CI runs)
#   bash scripts/test.sh --fast     in the active environment, no install: lint and the tests not marked slow
#                                   (about 90 s on 2 cores; every module is imported and most are exercised)
#
# GPU tests are marked `gpu` and skipped on machines without one; further arguments go to pytest.
# The tests not marked slow run on ASYNCRL_TEST_WORKERS pytest-xdist workers (default 2), a file to a worker:
# they are short and mostly wait on one core, so two workers take 1.7x less time on 2 cores. The slow tests run
# one after another: each starts a run whose processes keep every core busy, and their timing checks assume it.
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
status=0
"$PY" -m pytest -m "not gpu and not slow" -q --durations=10 -n "${ASYNCRL_TEST_WORKERS:-2}" --dist loadfile "$@" ||
  status=$?
[ "$fast" = 1 ] || "$PY" -m pytest -m "slow and not gpu" -q --durations=25 "$@" || status=$?
exit "$status"
