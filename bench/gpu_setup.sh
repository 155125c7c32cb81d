#!/usr/bin/env bash
# On a GPU machine without a package index: install what asyncrl needs beside the machine's own torch into
# /tmp/site (then run with PYTHONPATH=/tmp/site), from the wheels bench/offline_wheels.sh packed and that
# were copied into WHEELS (default /tmp/gpu). The pinned set (pinned.txt: the vLLM build and its pins,
# DeepSpeed's source) is installed as it is; any other wheel only where the machine lacks its distribution.
set -euo pipefail
WHEELS=${1:-/tmp/gpu}
CHECKOUT=$(cd "$(dirname "$0")/.." && pwd)
cd "$WHEELS"
for first in *.part.aa; do
  [ -e "$first" ] || continue
  cat "${first%.aa}"* > "${first%.part.aa}" && rm "${first%.aa}"*
done
missing=$(python3 - <<'PY'
import glob, importlib.metadata
pinned = {wheel.split("-")[0].lower() for wheel in open("pinned.txt").read().split()}
for wheel in sorted(glob.glob("*.whl")):
    name = wheel.split("-")[0]
    if name.lower() in pinned:
        continue
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PY
)
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$@"; }
pip_install --upgrade $(grep '\.whl$' pinned.txt) $missing
if [ -e deepspeed-0.19.8.tar.gz ]; then
  tar xzf deepspeed-0.19.8.tar.gz
  DS_BUILD_OPS=0 PYTHONPATH=/tmp/site pip_install --no-build-isolation ./deepspeed-0.19.8
fi
echo "installed the pinned set and $(echo $missing | wc -w) wheels the machine lacked"
# asyncrl itself runs from the checkout: its commands as small launchers beside the installed packages.
mkdir -p /tmp/site/bin
for entry in asyncrl:asyncrl.launch.cli asyncrl-generator:generators.cli asyncrl-learner:learners.cli; do
  printf '#!/bin/sh\nexec python3 -c "import sys; from %s import main; sys.exit(main())" "$@"\n' "${entry#*:}" \
    > "/tmp/site/bin/${entry%%:*}"
  chmod +x "/tmp/site/bin/${entry%%:*}"
done
echo "then: export PYTHONPATH=/tmp/site:$CHECKOUT PATH=/tmp/site/bin:\$PATH"
PYTHONPATH=/tmp/site python3 -c "import vllm, deepspeed, trl, peft; print('vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
