#!/usr/bin/env bash
# Install everything and run the CPU test suite (GPU tests are marked `gpu` and skipped here);
# the 25 slowest tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export DS_ACCELERATOR=cpu
exec "${PYTHON:-python3}" -m pytest -m "not gpu" -q --durations=25 "$@"
