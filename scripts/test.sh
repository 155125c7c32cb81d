#!/usr/bin/env bash
# The test suite.
#
#   bash scripts/test.sh            install everything (scripts/install.sh), lint, then every CPU test (what CI runs)
#   bash scripts/test.sh --fast     in the active environment, no install: lint and the tests not marked slow
#                                   (1.5-2 minutes on 2 cores; every module is imported and most are exercised)
#
# GPU tests are marked `gpu` and skipped on machines without one; further arguments go to pytest.
# Tests run on ASYNCRL_TEST_WORKERS pytest-xdist workers (default 2), a file to a worker: a short test mostly
# waits on one core, and a slow one (a whole run) keeps about 1.6 of 2 busy, so two workers take less time on
# 2 cores. Slow tests marked alone (a time budget that assumes the whole machine, one Ray cluster at a time)
# run last, one after another.
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
workers=(-n "${ASYNCRL_TEST_WORKERS:-2}" --dist loadfile)
status=0
"$PY" -m pytest -m "not gpu and not slow" -q --durations=10 "${workers[@]}" "$@" || status=$?
if [ "$fast" = 0 ]; then
  # The longest files first (tests/conftest.py), not xdist's order by count of tests: a long file handed out
  # last would leave the other worker idle at the end.
  "$PY" -m pytest -m "slow and not alone and not gpu" -q --durations=25 "${workers[@]}" --no-loadscope-reorder "$@" \
    || status=$?
  # Only the files that hold them, unless told which: collecting every test module takes 15 s on 2 cores.
  alone=("$@")
  [ $# -gt 0 ] || mapfile -t alone < <(grep -l "mark.alone" tests/test_*.py)
  "$PY" -m pytest -m "slow and alone and not gpu" -q --durations=10 "${alone[@]}" || status=$?
fi
exit "$status"
