"""How fast does a model learn to use a tool? Runs a multi-turn config and records the time to a reward target.

    python bench/tool_learning.py configs/hint-cpu.yaml --repeats 1 --out bench/results/hint_cpu

Each repeat is one ``asyncrl run`` of the config (its own budget, ``learner.max_train_s``, bounds it). The
record is the training wall-clock at which the mean reward of the last ``--window`` steps first reached
``--target`` (null where it never did), beside the final window's mean reward and tool calls per episode.
``--out`` keeps the last repeat's ``metrics.jsonl``, ``summary.json``, ``reward.png`` and ``run.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402


def time_to(steps: list[dict], target: float, window: int) -> float | None:
    """The first ``wall_s`` at which the mean reward of the last ``window`` steps is at least ``target``."""
    for i in range(window, len(steps) + 1):
        last = steps[i - window : i]
        if sum(s["reward"] for s in last) / window >= target:
            return last[-1]["wall_s"]
    return None


def run_once(config: str, work: Path, extra: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", config, "--run-dir", str(work), "--free-ports"]
    subprocess.run([*command, *extra], check=True, cwd=ROOT)
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None)
    records.add_argument(parser, "tool_learning")
    args, extra = parser.parse_known_args(argv)
    reached, final, calls = [], [], []
    for repeat in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="tool-learning-")) / "run"
        steps = run_once(args.config, work, extra)
        reached.append(time_to(steps, args.target, args.window))
        tail = steps[-args.window :]
        final.append(sum(s["reward"] for s in tail) / len(tail))
        calls.append(sum(s.get("tool_calls", 0.0) for s in tail) / len(tail))
        print(f"repeat {repeat}: reached {args.target} at {reached[-1]} s; final reward {final[-1]:.3f}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "summary.json", "reward.png", "config.yaml"):
                if (work / name).exists():
                    shutil.copy(work / name, args.out / name)
        shutil.rmtree(work.parent, ignore_errors=True)
    at = stamp(commit=args.commit)
    case = Path(args.config).stem
    settings = {"config": args.config, "overrides": extra, "target": args.target, "window": args.window}
    out = [
        records.measure(
            at,
            bench="tool_learning",
            case=case,
            metric=f"seconds_to_reward_{args.target:g}",
            unit="s",
            repeats=reached,
            higher_is_better=False,
            settings=settings,
            notes=f"training wall-clock until the mean reward of {args.window} steps in a row reached the target",
        ),
        records.measure(at, bench="tool_learning", case=case, metric="final_reward", unit="reward", repeats=final),
        records.measure(
            at, bench="tool_learning", case=case, metric="tool_calls_per_episode", unit="calls", repeats=calls
        ),
    ]
    if args.out is not None:
        run = {**settings, "machine": at.machine, "date": at.date, "commit": at.commit, "reached_s": reached}
        (args.out / "run.json").write_text(json.dumps({**run, "final_reward": final, "tool_calls": calls}, indent=2))
    records.write(args.records, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
