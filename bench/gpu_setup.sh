#!/usr/bin/env bash
# On a lent GPU machine: install DeepSpeed and the few wheels asyncrl needs that the image lacks,
# from a carried folder of wheels (see bench/README.md), into /tmp/site.
set -euo pipefail
WHEELS=${1:-.gpu/c6}
mkdir -p /tmp/gpu && cp "$WHEELS"/* /tmp/gpu/
cd /tmp/gpu
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  hjson-*.whl pydantic-*.whl pydantic_core-*.whl annotated_types-*.whl typing_inspection-*.whl \
  typing_extensions-*.whl msgspec-*.whl pyzmq-*.whl
tar xzf deepspeed-0.19.8.tar.gz
DS_BUILD_OPS=0 PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  --target /tmp/site ./deepspeed-0.19.8
PYTHONPATH=/tmp/site python3 -c "import deepspeed, msgspec; print('deepspeed', deepspeed.__version__)"
