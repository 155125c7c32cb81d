#!/usr/bin/env bash
# The learner as a run builds it on GPUS GPUs (default 1: no ZeRO for one rank; 2 or more: ZeRO-3) against a plain
# torch FSDP2 loop on as many: with Liger's
# kernels (--liger, what learner.liger_kernels: auto picks there) and without; the fused log-prob tail against
# plain autograd ops (--logprobs autograd); 4 micro-batches per optimizer step; then the longest 1.5B sequence.
# Every run appends to OUT:
#   bash bench/learner_gpus.sh OUT.jsonl [GPUS]
#   python bench/learner_report.py OUT.jsonl --out bench/results/learner_${GPUS}gpu.json --commit "$(git rev-parse --short HEAD)"
set -uo pipefail
OUT=${1:?output jsonl}; GPUS=${2:-1}
run() { timeout "${T:-90}" torchrun --standalone --nproc_per_node "$GPUS" bench/learner_bench.py --steps 4 --warmup 2 \
          --out "$OUT" "$@" || echo "failed: $*"; }
run --impl fsdp2 --model 0.5b --seq 4096 16384 32768
run --impl asyncrl --model 0.5b --seq 4096 16384 32768 --liger
run --impl asyncrl --model 0.5b --seq 4096 16384 32768
run --impl fsdp2 --model 1.5b --seq 4096 16384 32768
run --impl asyncrl --model 1.5b --seq 4096 16384 32768 --liger
run --impl asyncrl --model 1.5b --seq 4096 16384 32768
for tail in fused autograd; do
  run --impl fsdp2 --model 1.5b --seq 16384 --no-checkpointing --logprobs $tail
  run --impl asyncrl --model 1.5b --seq 16384 --no-checkpointing --liger --logprobs $tail
done
run --impl fsdp2 --model 1.5b --seq 16384 --no-checkpointing --accumulate 4
run --impl asyncrl --model 1.5b --seq 16384 --no-checkpointing --liger --accumulate 4
T=150 run --impl asyncrl --model 1.5b --seq 65536 131072 --tokens-per-gpu 1 --liger
