#!/usr/bin/env bash
# ZeRO-3 across two GPUs (the learner as a run builds it, at its GPU defaults) against a plain torch FSDP2 loop,
# 0.5B and 1.5B from 4k to 32k tokens, with and without Liger's kernels; then 4 micro-batches per optimizer step.
# Every run appends to OUT:
#   bash bench/learner_2gpu.sh OUT.jsonl
#   python bench/learner_report.py OUT.jsonl --out bench/results/learner_2gpu.json --commit "$(git rev-parse --short HEAD)"
set -uo pipefail
OUT=${1:?output jsonl}
run() { timeout "${T:-120}" torchrun --standalone --nproc_per_node 2 bench/learner_bench.py --steps 4 --warmup 2 \
          --out "$OUT" "$@" || echo "failed: $*"; }
run --impl fsdp2 --model 0.5b --seq 4096 16384
run --impl asyncrl --model 0.5b --seq 4096 16384 --liger
run --impl asyncrl --model 0.5b --seq 4096 16384
run --impl fsdp2 --model 1.5b --seq 4096 16384 32768
run --impl asyncrl --model 1.5b --seq 4096 16384 32768 --liger
run --impl asyncrl --model 1.5b --seq 4096 16384 32768
run --impl fsdp2 --model 1.5b --seq 16384 --no-checkpointing --accumulate 4
run --impl asyncrl --model 1.5b --seq 16384 --no-checkpointing --liger --accumulate 4
