"""Learner runs (``learner_bench.py`` JSONL) as one JSON: each beside the FSDP2 run of the same shape, with the ratio.

    python bench/learner_report.py runs.jsonl --out bench/results/learner_1gpu.json --commit abc1234

A run is paired with the FSDP2 run of the same model, sequence length, rows
per GPU, GPU count, activation checkpointing, micro-batches per step, log-prob
tail and commit, where runs name theirs (FSDP2 as its users write it: no Liger).
Also reported: the best MFU per model and the longest sequence each model
trained at without running out of memory. Every asyncrl run that finished is
appended to ``bench/records/learner.jsonl``: tokens/s per GPU beside FSDP2's
where there is an FSDP2 run of its shape, MFU and peak memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import short_commit, short_machine  # noqa: E402

TOKENS_PER_GPU = 16384  # learner_bench.py's default rows per step: max(1, TOKENS_PER_GPU // seq)


def shape(r: dict) -> tuple:
    """What an asyncrl run and its FSDP2 peer share: model, length, rows, GPUs, checkpointing, micro-batches, tail."""
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


def report(records: list[dict]) -> dict:
    """The runs paired with FSDP2, the best MFU per model and the longest sequence per model."""
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
    parser.add_argument("--machine", default=None, help="default: this machine's GPUs, torch and vLLM")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--commit", default=None, help="default: the checkout's HEAD (runs that name theirs keep it)")
    records.add_argument(parser, "learner")
    args = parser.parse_args()
    runs = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    at = records.Stamp(commit=args.commit or short_commit(), date=args.date, machine=args.machine or short_machine())
    result = {
        "what": __doc__.split("\n")[0],
        "machine": at.machine,
        "date": at.date,
        "commit": at.commit,
        **report(runs),
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
    records.write(args.records, records_of(runs, at))


def case_of(run: dict) -> str:
    """A run's case: model, tokens per sequence and GPUs, then whatever differs from the learner a run builds."""
    parts = [run["model"], f"{run['seq'] // 1024}k tokens", f"{run['gpus']} GPU" + ("s" if run["gpus"] > 1 else "")]
    if run["impl"] != "asyncrl":
        parts.append(run["impl"])
    if run["batch_per_gpu"] != max(1, TOKENS_PER_GPU // run["seq"]):
        parts.append(f"{run['batch_per_gpu']} rows")
    if not run.get("checkpointing", True):
        parts.append("no checkpointing")
    if run.get("accumulate", 1) > 1:
        parts.append(f"{run['accumulate']} micro-batches per step")
    if not run.get("liger", False):
        parts.append("without Liger")
    if run.get("logprobs", "autograd") != "fused":
        parts.append("autograd log-prob tail")
    for key, label in (("bucket_mb", "bucket_mb={}"), ("persistence", "persistence={:g}")):
        if key in run:
            parts.append(label.format(run[key]))
    return ", ".join(parts)


def records_of(runs: list[dict], at: records.Stamp) -> list[records.Record]:
    """Each finished asyncrl run: tokens/s per GPU (beside the FSDP2 run of its shape, if any), MFU, peak memory.

    A run that names its commit keeps it; the others take ``at``'s. One timing per run (the mean over its
    timed steps), so n = 1."""
    done = [r for r in runs if not r.get("oom")]
    fsdp2 = {shape(r): r for r in done if r["impl"] == "fsdp2" and not r.get("liger")}
    out = []
    for run in done:
        if run["impl"] == "fsdp2":
            continue
        peer = fsdp2.get(shape(run))
        commit = run.get("commit") or at.commit
        here = records.Stamp(commit=commit, date=at.date, machine=at.machine)
        settings = {
            key: run[key]
            for key in ("impl", "model", "seq", "batch_per_gpu", "gpus", "checkpointing", "liger", "accumulate")
            if key in run
        }
        settings.update({key: run[key] for key in ("logprobs", "zero_stage", "bucket_mb", "persistence") if key in run})
        common = dict(bench="learner", case=case_of(run), settings=settings)
        out += [
            records.measure(
                here,
                **common,
                metric="tokens_per_s_per_gpu",
                unit="tokens/s",
                repeats=[run["tokens_per_s_per_gpu"]],
                vs=None if peer is None else records.peer("FSDP2", [peer["tokens_per_s_per_gpu"]]),
            ),
            records.measure(here, **common, metric="mfu", unit="of 989 TFLOP/s", repeats=[run["mfu"]]),
            records.measure(
                here, **common, metric="peak_mem_gb", unit="GB", repeats=[run["peak_mem_gb"]], higher_is_better=False
            ),
        ]
    return out


if __name__ == "__main__":
    main()
