"""Run outputs users plot: ``metrics.jsonl``, TensorBoard events and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per learner step and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Every step adds dozens of scalars: write them in large batches, not ten at a time.
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), max_queue=1000, flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        # NaN and Infinity (a diverged step) are not JSON: written as null, which every reader takes
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
        self._file.write(json.dumps(finite, allow_nan=False) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])

    def resume_at(self, step: int) -> None:
        """Drop TensorBoard's points of the steps after ``step``: a resumed run trains them again."""
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(
                str(self.run_dir / "tensorboard"), max_queue=1000, flush_secs=10, purge_step=step + 1
            )

    def scalars(self, values: dict[str, float], step: int) -> None:
        """TensorBoard only: values that are not one step's record (held-out evaluations)."""
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def last_metrics(run_dir: str | Path, tail_bytes: int = 1 << 16) -> dict[str, Any] | None:
    """The newest complete record of a run's ``metrics.jsonl``, read from the file's end: a progress bar
    polls it twice a second, and a long-lived run's file grows past what is worth parsing that often."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # the line being written, or the first one cut by the seek
            continue
    return None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl`` (empty if there is none yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line still being written
    return records


def plot_reward(run_dir: str | Path, max_reward: float | None = None, out_name: str = "reward.png") -> Path:
    """Reward against learner step and against wall-clock time, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = scored(read_metrics(run_dir))
    steps = [r["step"] for r in records]
    wall = [r["wall_s"] for r in records]
    reward = [r["reward"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, x, label in ((axes[0], steps, "learner step"), (axes[1], wall, "wall-clock (s)")):
        ax.plot(x, reward, lw=0.8, alpha=0.4, color="tab:blue")
        ax.plot(x, smooth(reward), lw=2, color="tab:blue", label="reward (smoothed)")
        if max_reward is not None:
            ax.axhline(max_reward, ls="--", color="grey", lw=1, label="max reward")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    evals = in_step_order(read_jsonl(Path(run_dir) / "eval.jsonl"))
    if evals:
        axes[0].plot(
            [e["step"] for e in evals],
            [e["pass@1"] for e in evals],
            "o-",
            color="tab:green",
            label="held-out pass@1 (greedy)",
        )
        k = next((key for key in evals[0] if key.startswith("pass@") and key != "pass@1"), None)
        if k is not None:
            axes[0].plot(
                [e["step"] for e in evals], [e[k] for e in evals], "s--", color="tab:olive", label=f"held-out {k}"
            )
    axes[0].set_ylabel("mean reward / held-out pass rate")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{Path(run_dir).name}: reward")
    fig.tight_layout()
    out = Path(run_dir) / out_name
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file a run wrote (empty if there is none yet)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def in_step_order(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out evaluations (``eval.jsonl``'s records) by step: the file is in the order they finished, which need
    not be the steps' (a piece of an older one may wait on a slow generator while a later one completes)."""
    return sorted(evals, key=lambda e: (e["step"], e.get("version", 0)))


def reward_text(reward: float | None) -> str:
    """A step's reward for a progress bar: ``failed`` where every reward of the step failed."""
    return "failed" if reward is None else f"{reward:.3f}"


def scored(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of steps that have a reward: one whose every reward failed has none (``reward`` null)."""
    return [r for r in records if r.get("reward") is not None]


def smooth(values: list[float], window: int = 20) -> list[float]:
    """The mean of the last ``window`` values at each point (fewer at the start), skipping values that are not
    finite: one ``inf`` (a ``mismatch_kl`` that overflowed) spoils its own window, not the rest of the curve."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i + 1 - window) : i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out
