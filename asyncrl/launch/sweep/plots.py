"""The PNGs of ``asyncrl sweep``'s report: one line per cell, the mean over its seeds and a min-max band.

Seeds are interpolated onto the x values they all cover (the union of their
own x values between the latest start and the earliest end), so the mean at
every point is over the same seeds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.launch.sweep.grid import SMOOTH_STEPS
from asyncrl.observe.metrics import in_step_order, smooth

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from asyncrl.launch.sweep.grid import Cell
    from asyncrl.launch.sweep.report import RunResult

LINESTYLES = ("-", "--", ":", "-.")
WALL = "wall-clock since the first batch (s)"
Groups = Sequence[tuple["Cell", list["RunResult"]]]  # each cell with its finished runs
Curve = Callable[["RunResult"], tuple[Sequence[float], Sequence[float]] | None]


def plot_all(out: Path, groups: Groups, target_reward: float | None) -> list[tuple[str, str]]:
    """Write every plot the runs have data for into ``out``; returns ``(caption, file name)`` pairs."""
    import matplotlib

    matplotlib.use("Agg")
    if not groups:
        return []
    runs = [r for _, ok in groups for r in ok]
    styles = _styles([cell for cell, _ in groups])
    mean_of = f"running mean of {SMOOTH_STEPS} steps"
    plots = [
        (
            "reward vs learner step and wall-clock",
            _curves(
                out / "reward.png",
                groups,
                styles,
                "Training reward",
                f"reward ({mean_of})",
                [("learner step", _metric("step", "reward")), (WALL, _metric("wall_s", "reward"))],
                target_reward,
            ),
        )
    ]
    if any(r.evals for r in runs):
        plots.append(
            (
                "held-out pass@1 vs learner step and wall-clock",
                _curves(
                    out / "eval_pass1.png",
                    groups,
                    styles,
                    "Held-out pass@1 (greedy)",
                    "pass@1",
                    [("learner step", _eval(wall=False)), (WALL, _eval(wall=True))],
                    marker="o",
                    ymin=-0.02,
                ),
            )
        )
    if any(r.mismatch_kl is not None for r in runs):
        plots.append(
            (
                "mismatch KL vs learner step",
                _curves(
                    out / "mismatch_kl.png",
                    groups,
                    styles,
                    "Generator vs learner mismatch KL",
                    f"mismatch KL ({mean_of})",
                    [("learner step", _metric("step", "mismatch_kl"))],
                ),
            )
        )
    plots.append(("samples/s per cell", _throughput(out / "samples_per_s.png", groups, styles)))
    if any(r.staleness for r in runs):
        plots.append(("staleness of the samples trained on, per cell", _staleness(out / "staleness.png", groups)))
    return plots


def _styles(cells: Sequence[Cell]) -> list[dict]:
    """Two grids: colour by the first's value, line style by the second's; otherwise a colour per cell."""
    if len(cells[0].values) == 2:
        first = list(dict.fromkeys(c.values[0][1] for c in cells))
        second = list(dict.fromkeys(c.values[1][1] for c in cells))
        if len(first) <= 10 and len(second) <= len(LINESTYLES):
            return [
                {"color": f"C{first.index(c.values[0][1])}", "ls": LINESTYLES[second.index(c.values[1][1])]}
                for c in cells
            ]
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(cells) <= 10 else "tab20"]
    return [{"color": cmap(i % cmap.N), "ls": "-"} for i in range(len(cells))]


def _metric(x_key: str, y_key: str) -> Curve:
    """``y_key`` of metrics.jsonl (running mean) against ``x_key``."""

    def curve(run: RunResult) -> tuple[list[float], list[float]] | None:
        rows = [r for r in run.records if r.get(y_key) is not None]
        return ([r[x_key] for r in rows], smooth([r[y_key] for r in rows], SMOOTH_STEPS)) if rows else None

    return curve


def _eval(wall: bool) -> Curve:
    """Held-out pass@1 against the step, or the wall-clock of that step in metrics.jsonl (step 0: the start);
    ``band`` needs its x sorted, and eval.jsonl is in the order evaluations finished."""

    def curve(run: RunResult) -> tuple[list[float], list[float]] | None:
        if not run.evals:
            return None
        evals = in_step_order(run.evals)
        steps = [e["step"] for e in evals]
        if wall:
            steps = list(
                np.interp(steps, [0] + [r["step"] for r in run.records], [0.0] + [r["wall_s"] for r in run.records])
            )
        return steps, [e["pass@1"] for e in evals]

    return curve


def band(curves: Sequence[tuple[Sequence[float], Sequence[float]]]) -> tuple[np.ndarray, ...] | None:
    """``(x, mean, min, max)`` of the seeds' curves over the x range they all cover; None if there is none."""
    curves = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x)]
    if not curves:
        return None
    low, high = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    grid = np.unique(np.concatenate([x for x, _ in curves]))
    grid = grid[(grid >= low) & (grid <= high)]
    if not len(grid):
        return None
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def _curves(
    path: Path,
    groups: Groups,
    styles: list[dict],
    title: str,
    ylabel: str,
    panels: list[tuple[str, Curve]],
    target: float | None = None,
    marker: str | None = None,
    ymin: float | None = None,
) -> str:
    """One panel per ``(x label, curve)``, sharing the y axis; a line and a band per cell."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, (xlabel, curve) in zip(axes[0], panels):
        for (cell, runs), style in zip(groups, styles):
            stats = band([c for c in map(curve, runs) if c is not None])
            if stats is None:
                continue
            x, mean, low, high = stats
            seeds = f"{len(runs)} seed{'s' * (len(runs) > 1)}"
            ax.plot(x, mean, lw=1.8, marker=marker, ms=3, label=f"{cell.label} ({seeds})", **style)
            ax.fill_between(x, low, high, color=style["color"], alpha=0.15, lw=0)
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=1, label=f"target reward {target:g}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    if ymin is not None:
        axes[0][0].set_ylim(bottom=ymin)  # shared by the panels; a little below 0 keeps a curve at 0 visible
    axes[0][0].set_ylabel(ylabel)
    _legend(fig, axes[0][0])
    fig.suptitle(title)
    return _save(fig, path)


def _legend(fig: Figure, ax: Axes) -> None:
    """Outside the axes, to the right, so it never covers a curve."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def _save(fig: Figure, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path.name


def _throughput(path: Path, groups: Groups, styles: list[dict]) -> str:
    """A horizontal bar per cell (long labels stay readable): mean samples/s, whiskers from min to max."""
    import matplotlib.pyplot as plt

    values = [[r.summary.get("achieved_samples_per_s", 0.0) for r in runs] for _, runs in groups]
    means = [float(np.mean(v)) for v in values]
    errors = [[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * len(groups)))
    y = np.arange(len(groups))
    ax.barh(y, means, xerr=errors, capsize=3, color=[s["color"] for s in styles], alpha=0.8)
    ax.set_yticks(y, [cell.label for cell, _ in groups], fontsize=8)
    ax.invert_yaxis()  # first cell on top, as in the report's table
    ax.set_xlabel("achieved samples/s (bar: mean over seeds; whiskers: min to max)")
    ax.set_title("Throughput per cell")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _staleness(path: Path, groups: Groups) -> str:
    """One small histogram per cell: the share of consumed samples at each staleness, all seeds together."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = min(len(groups), 5)
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(2.8 * cols, 0.6 + 2.6 * rows), sharex=True, sharey=True, squeeze=False
    )
    top = max((s for _, runs in groups for r in runs for s in r.staleness), default=0)
    for ax, (cell, runs) in zip(axes.flat, groups):
        counts = sum((r.staleness for r in runs), Counter())
        total = sum(counts.values()) or 1
        ax.bar(range(top + 1), [counts[s] / total for s in range(top + 1)], color="tab:blue")
        mean = sum(s * n for s, n in counts.items()) / total
        ax.set_title(f"{cell.label.replace(', ', chr(10))}\nmean {mean:.2f}", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="y", alpha=0.3)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    in_last_row = len(groups) - (rows - 1) * cols
    for col in range(cols):  # the lowest drawn panel of each column carries the x axis
        ax = axes[rows - 1 if col < in_last_row else rows - 2, col]
        ax.tick_params(labelbottom=True)
        ax.set_xlabel("staleness (versions)")
    for ax in axes[:, 0]:
        ax.set_ylabel("share of samples")
    fig.suptitle("Staleness of the samples trained on")
    return _save(fig, path)
