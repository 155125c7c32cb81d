#!/usr/bin/env bash
# ZeRO-3 fetch settings against FSDP2 on 2 GPUs, one model and sequence length, one JSONL.
#   bash bench/learner_tuning.sh OUT.jsonl [MODEL] [SEQ]
set -uo pipefail
OUT=${1:?output jsonl}; MODEL=${2:-0.5b}; SEQ=${3:-4096}
run() { timeout 120 torchrun --standalone --nproc_per_node 2 bench/learner_bench.py --model "$MODEL" --seq "$SEQ" \
          --steps 4 --warmup 2 --out "$OUT" "$@" || echo "failed: $*"; }
run --impl fsdp2
run --impl zero3
run --impl zero3 --granularity 2000000
run --impl zero3 --allreduce-fetch
run --impl zero3 --granularity 2000000 --bucket-elements 1048576000 --persistence 10000000
