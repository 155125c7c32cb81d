#!/usr/bin/env bash
# The docs site: `bash scripts/docs.sh` serves it on http://127.0.0.1:8000; `bash scripts/docs.sh build` builds site/ (strict).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, on every build
if [ "${1:-serve}" = build ]; then
  exec "$PY" -m mkdocs build --strict "${@:2}"
fi
exec "$PY" -m mkdocs serve --strict "${@:2}"
