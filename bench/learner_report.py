"""Learner runs (``learner_bench.py`` JSONL) as one JSON: each beside the FSDP2 run of the same shape, with the ratio.

    python bench/learner_report.py runs.jsonl --out bench/results/learner_1gpu.json --commit abc1234

A run is paired with the FSDP2 run of the same model, sequence length, rows
per GPU, GPU count, activation checkpointing, micro-batches per step, log-prob
tail and commit, where runs name theirs (FSDP2 as its users write it: no Liger).
Also reported: the best MFU per model and the longest sequence each model
trained at without running out of memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path


def report(records: list[dict]) -> dict:
    def shape(r: dict) -> tuple:
        return (
            r["model"],
            r["seq"],
            r["batch_per_gpu"],
            r["gpus"],
            r.get("checkpointing", True),
            r.get("accumulate", 1),
            r.get("logprobs", "autograd"),
            r.get("commit"),
        )

    done = [r for r in records if not r.get("oom")]
    fsdp2 = {shape(r): r for r in done if r["impl"] == "fsdp2" and not r.get("liger")}
    pairs = []
    for r in done:
        peer = fsdp2.get(shape(r))
        if r["impl"] != "fsdp2" and peer is not None:
            settings = {
                key: r[key]
                for key in ("zero_stage", "bucket_mb", "persistence", "granularity", "allreduce_fetch")
                if key in r
            }
            pairs.append(
                {
                    "impl": r["impl"],
                    **settings,
                    "liger": r.get("liger", False),
                    "model": r["model"],
                    "seq": r["seq"],
                    "gpus": r["gpus"],
                    "checkpointing": r.get("checkpointing", True),
                    "accumulate": r.get("accumulate", 1),
                    "logprobs": r.get("logprobs", "autograd"),
                    "tokens_per_s_per_gpu": round(r["tokens_per_s_per_gpu"]),
                    "fsdp2_tokens_per_s_per_gpu": round(peer["tokens_per_s_per_gpu"]),
                    "over_fsdp2": round(r["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"], 3),
                    "mfu": round(r["mfu"], 3),
                    "fsdp2_mfu": round(peer["mfu"], 3),
                }
            )
    asyncrl = [r for r in done if r["impl"] != "fsdp2"]
    return {
        "pairs": pairs,
        "best_mfu": {
            m: round(max(r["mfu"] for r in asyncrl if r["model"] == m), 3)
            for m in sorted({r["model"] for r in asyncrl})
        },
        "max_seq_tokens": {
            m: max(r["seq"] for r in asyncrl if r["model"] == m) for m in sorted({r["model"] for r in asyncrl})
        },
        "runs": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", default="NVIDIA H200")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    result = {
        "what": __doc__.split("\n")[0],
        "machine": args.machine,
        "date": args.date,
        "commit": args.commit,
        **report(records),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for pair in result["pairs"]:
        print(
            f"{pair['impl']:8} liger={pair['liger']!s:5} {pair['model']} {pair['seq']:>6} "
            f"ckpt={pair['checkpointing']!s:5} x{pair['accumulate']} {pair['logprobs']:8} "
            f"{pair['over_fsdp2']:.2f}x FSDP2, "
            f"MFU {pair['mfu']:.3f}"
        )
    print("best MFU", result["best_mfu"], "longest", result["max_seq_tokens"])


if __name__ == "__main__":
    main()
