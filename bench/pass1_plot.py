"""Held-out pass@1 against seconds of training, for runs kept by ``learning_run.py``, on one plot.

    python bench/pass1_plot.py bench/results/arith_lora_h200/full/run.json \
        bench/results/arith_lora_h200/lora/run.json --labels "full fine-tuning" "LoRA rank 4" \
        --out bench/results/arith_lora_h200/pass1.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run.json files written by learning_run.py")
    parser.add_argument("--labels", nargs="+", help="one per run (default: the run's command)")
    parser.add_argument("--title", default="held-out pass@1 (greedy) by training time")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    labels = args.labels or [json.loads(p.read_text())["what"] for p in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.runs)} runs")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for path, label in zip(args.runs, labels):
        run = json.loads(path.read_text())
        seconds, pass1 = zip(*run["pass@1_by_training_s"])
        ax.plot(seconds, pass1, marker="o", label=f"{label} ({run['steps']} steps)")
    ax.set(xlabel="seconds of training", ylabel="held-out pass@1", ylim=(0, 1.02), title=args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
