"""The learner's log-prob tail, one chunk, forward and backward: the fused function against autograd's ops.

Within each log-prob chunk the learner goes from the logits to the targets'
log-probs, the entropy and their gradients. Two ways are timed side by side
on the same logits:

* ``fused``: ``learners.loss._LogprobsFromLogits``, a hand-written backward,
  compiled on a GPU and run eagerly on CPU;
* ``autograd``: ``learners.loss.autograd_logprobs``, torch's log-softmax and
  gather under autograd.

The learner uses ``fused`` on a GPU and ``autograd`` on CPU; this is the
measurement behind that choice.

    python bench/logprob_tail_bench.py --vocab 49152 151936 --out bench/results/logprob_tail_cpu.json

Also appends, per vocabulary, the fused tail's seconds beside autograd's to
``bench/records/logprob_tail_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import records  # noqa: E402
from bench.provenance import head_commit, machine, stamp  # noqa: E402
from learners.loss import _LogprobsFromLogits, autograd_logprobs  # noqa: E402


def timed(
    fn: Callable, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, repeats: int
) -> list[float]:
    """Seconds per forward + backward of ``fn`` (log-probs and entropy both in the loss), after one warm-up."""
    times = []
    for i in range(repeats + 1):
        leaf = logits.detach().requires_grad_()
        if leaf.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        picked, entropy = fn(leaf, targets, 0.9, True)
        ((picked + 0.01 * entropy) * weights).sum().backward()
        if leaf.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152])
    parser.add_argument("--tokens", type=int, default=1024, help="positions per chunk (learner.logprob_chunk_tokens)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the logits' dtype")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--out", type=Path, required=True)
    records.add_argument(parser, "logprob_tail_bench")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    ways = {"fused": _LogprobsFromLogits.apply, "autograd": autograd_logprobs}
    rows = []
    for vocab in args.vocab:
        generator = torch.Generator(device=device).manual_seed(0)
        logits = 4 * torch.randn(args.tokens, vocab, device=device, generator=generator)
        logits = logits.to(getattr(torch, args.dtype))
        targets = torch.randint(0, vocab, (args.tokens,), device=device, generator=generator)
        weights = torch.randn(args.tokens, device=device, generator=generator)
        row = {"vocab": vocab}
        for name, fn in ways.items():
            times = timed(fn, logits, targets, weights, args.repeats)
            row[f"{name}_s"] = statistics.median(times)
            row[f"{name}_s_all"] = times
        row["autograd_over_fused"] = row["autograd_s"] / row["fused_s"]
        rows.append(row)
        print(
            f"vocab {vocab}: fused {row['fused_s']:.3f} s, autograd {row['autograd_s']:.3f} s per {args.tokens} "
            f"tokens (fused runs at {row['autograd_over_fused']:.2f}x autograd's speed)",
            flush=True,
        )
    report = {
        "machine": machine(device == "cuda"),
        "threads": torch.get_num_threads(),
        "device": device,
        "date": datetime.date.today().isoformat(),
        "commit": head_commit() or None,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "compiled": device == "cuda",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    records.write(args.records, records_of(report, stamp(device == "cuda")))
    return 0


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Per vocabulary: seconds per chunk, forward and backward, of the fused tail beside autograd's, over repeats."""
    settings = {key: report[key] for key in ("device", "threads", "tokens", "dtype", "compiled")}
    return [
        records.measure(
            at,
            bench="logprob_tail_bench",
            case=f"vocab {row['vocab']}, {report['device']}",
            metric="chunk_s",
            unit="s",
            repeats=row["fused_s_all"],
            higher_is_better=False,
            vs=records.peer("autograd", row["autograd_s_all"], higher_is_better=False),
            settings=settings,
        )
        for row in report["rows"]
    ]


if __name__ == "__main__":
    sys.exit(main())
