"""The report of an ``asyncrl sweep``: ``sweep.csv``, ``report.md`` and its PNGs, from the run dirs alone.

Each (cell, seed) run dir is read as :class:`RunResult`; cells are compared
by their mean and spread over seeds, and by time to a target reward, with
the async/sync speedup against the cell whose ``staleness.max_staleness`` is 0.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.launch.sweep.grid import (
    SEED_KEYS,
    SMOOTH_STEPS,
    SYNC_KEY,
    Cell,
    Grid,
    finished,
    flatten,
    make_cells,
    run_path,
)
from asyncrl.launch.sweep.plots import plot_all
from asyncrl.observe.metrics import read_jsonl, read_metrics, scored, smooth


@dataclass
class RunResult:
    """What the report reads of one (cell, seed) run dir."""

    cell: Cell
    seed: int
    path: Path
    status: str  # ok (summary.json), failed (error.txt) or missing (not run yet)
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json, flattened
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl
    staleness: Counter[int] = field(default_factory=Counter)  # consumed samples by staleness
    reached: tuple[float, int] | None = None  # (wall_s, step) at which the reward reached the target

    @property
    def stale_drop_rate(self) -> float | None:
        if self.status != "ok":
            return None
        dropped = sum(v for k, v in self.summary.items() if k.startswith("samples_dropped."))
        total = self.summary.get("samples_consumed", 0) + dropped
        return self.summary.get("samples_dropped.stale", 0) / total if total else None

    @property
    def mismatch_kl(self) -> float | None:
        """The mean over the steps that have a finite one: one step that overflowed does not hide the rest."""
        values = [
            r["mismatch_kl"]
            for r in self.records
            if r.get("mismatch_kl") is not None and math.isfinite(r["mismatch_kl"])
        ]
        return statistics.fmean(values) if values else None


def time_to_target(
    records: Sequence[dict[str, Any]], target: float | None, window: int = SMOOTH_STEPS
) -> tuple[float, int] | None:
    """``(wall_s, step)`` of the first record whose reward, averaged over the last ``window`` steps, reaches
    ``target``. Only full windows count: at the start, one lucky step would be the whole mean."""
    if target is None:
        return None
    records = scored(records)
    means = smooth([r["reward"] for r in records], window)
    for record, reward in list(zip(records, means))[window - 1 :]:
        if reward >= target:
            return record["wall_s"], record["step"]
    return None


def load_run(out: Path, cell: Cell, seed: int, target_reward: float | None) -> RunResult:
    """What one (cell, seed)'s run dir holds; a run that did not finish comes back ``failed`` (it left
    ``error.txt``) or ``missing``, with nothing read from its files."""
    path = run_path(out, cell, seed)
    if not finished(path):
        return RunResult(cell, seed, path, "failed" if (path / "error.txt").exists() else "missing")
    records = read_metrics(path)
    consumed = read_jsonl(path / "consumed.jsonl")
    return RunResult(
        cell,
        seed,
        path,
        "ok",
        flatten(json.loads((path / "summary.json").read_text())),
        records,
        read_jsonl(path / "eval.jsonl"),
        Counter(r["staleness"] for r in consumed),
        time_to_target(records, target_reward),
    )


def build_report(out_dir: str | Path, target_reward: float | None = None) -> Path:
    """``sweep.csv``, the PNGs and ``report.md`` from ``out_dir``'s run dirs; returns the report's path.

    ``target_reward`` unset: the one stored in ``sweep.json``.
    """
    out = Path(out_dir)
    spec = json.loads((out / "sweep.json").read_text())
    target = target_reward if target_reward is not None else spec.get("target_reward")
    grids = [(key, tuple(values)) for key, values in spec["grids"]]
    cells = make_cells(grids)
    runs = [load_run(out, cell, seed, target) for cell in cells for seed in range(spec["seeds"])]
    write_csv(out / "sweep.csv", [key for key, _ in grids], runs)
    groups = [(cell, [r for r in runs if r.cell == cell and r.status == "ok"]) for cell in cells]
    plots = plot_all(out, [(cell, ok) for cell, ok in groups if ok], target)
    report = out / "report.md"
    report.write_text(_markdown(out, spec, target, grids, groups, runs, plots))
    return report


def write_csv(path: Path, keys: list[str], runs: Sequence[RunResult]) -> None:
    """One row per (cell, seed): the cell's values, seed, status, summary.json's scalars, derived columns."""
    summary_keys = list(
        dict.fromkeys(
            k for r in runs for k, v in r.summary.items() if isinstance(v, (int, float, str, bool)) or v is None
        )
    )
    columns = [
        *keys,
        "seed",
        "status",
        *summary_keys,
        "stale_drop_rate",
        "mismatch_kl_mean",
        "time_to_target_s",
        "steps_to_target",
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="", extrasaction="ignore")
        writer.writeheader()
        for r in runs:
            writer.writerow(
                {
                    **r.summary,
                    **dict(r.cell.values),
                    "seed": r.seed,
                    "status": r.status,
                    "stale_drop_rate": r.stale_drop_rate,
                    "mismatch_kl_mean": r.mismatch_kl,
                    "time_to_target_s": r.reached and r.reached[0],
                    "steps_to_target": r.reached and r.reached[1],
                }
            )


def _stat(values: Sequence[float | None], fmt: str) -> str:
    """``mean ± std`` (sample std) over the values that exist and are finite; ``-`` when none does."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    mean = format(statistics.fmean(values), fmt)
    return mean if len(values) == 1 else f"{mean} ± {statistics.stdev(values):{fmt}}"


def speedups(grids: Sequence[Grid], groups: Sequence[tuple[Cell, list[RunResult]]]) -> dict[Cell, str] | None:
    """Per cell with max_staleness > 0: mean time to target of the same cell at max_staleness=0 over its own.

    The means are over the seeds that reached the target. Where a finished seed of either cell did not, the
    ratio says how many did, ``"2.00x (1/3 vs 3/3 reached)"`` (this cell's, then the sync cell's): the seeds
    that reached it are the fast ones, so the ratio favours the cell where fewer did. ``-`` where either cell
    has none. None when the grid has no ``staleness.max_staleness=0``.
    """
    values = dict(grids).get(SYNC_KEY, ())
    sync_value = next((v for v in values if yaml.safe_load(v) == 0), None)
    if sync_value is None:
        return None
    mean_ttt, reached = {}, {}  # reached: (seeds that reached the target, seeds that finished)
    for cell, ok in groups:
        times = [r.reached[0] for r in ok if r.reached]
        mean_ttt[cell] = statistics.fmean(times) if times else None
        reached[cell] = (len(times), len(ok))
    out = {}
    for cell, _ in groups:
        if dict(cell.values)[SYNC_KEY] == sync_value:
            out[cell] = "baseline"
            continue
        sync_cell = Cell(tuple((k, sync_value if k == SYNC_KEY else v) for k, v in cell.values))
        sync, mine = mean_ttt[sync_cell], mean_ttt[cell]
        if not (sync and mine):
            out[cell] = "-"
        elif all(n == of for n, of in (reached[cell], reached[sync_cell])):
            out[cell] = f"{sync / mine:.2f}x"
        else:
            (n, of), (sync_n, sync_of) = reached[cell], reached[sync_cell]
            out[cell] = f"{sync / mine:.2f}x ({n}/{of} vs {sync_n}/{sync_of} reached)"
    return out


def _markdown(
    out: Path,
    spec: dict[str, Any],
    target: float | None,
    grids: Sequence[Grid],
    groups: Sequence[tuple[Cell, list[RunResult]]],
    runs: Sequence[RunResult],
    plots: Sequence[tuple[str, str]],
) -> str:
    status, seeds, extra = Counter(r.status for r in runs), spec["seeds"], spec["extra_overrides"]
    command = [
        "asyncrl",
        "sweep",
        spec["config"],
        *(f"--grid={k}={','.join(v)}" for k, v in grids),
        f"--seeds={seeds}",
        "--out",
        "DIR",
        *([f"--target-reward={target}"] if target is not None else []),
        *(["--", *extra] if extra else []),
    ]
    speedup = speedups(grids, groups) if target is not None else None
    lines = [
        f"# Sweep of {Path(spec['config']).name}",
        "",
        f"* config: `{spec['config']}` (sha256 {spec['config_sha256'][:12]})",
        *(f"* grid: `{key}` = {', '.join(f'`{v}`' for v in values)}" for key, values in grids),
        f"* seeds: {', '.join(map(str, range(seeds)))} (`{'`, `'.join(SEED_KEYS)}`)",
        f"* overrides for every run: {f'`{shlex.join(extra)}`' if extra else 'none'}",
        f"* target reward: {target:g} (time to target: the first wall-clock second of training at which the "
        f"reward's running mean over {SMOOTH_STEPS} steps reaches it)"
        if target is not None
        else "* target reward: none (pass --target-reward for time to target and the async/sync speedup)",
        f"* runs: {status['ok']} finished, {status['failed']} failed, {status['missing']} not run",
        "",
        f"Reproduce: `{shlex.join(command)}`",
        "",
        "## Per cell",
        "",
        "Mean ± std over the seeds that finished (time to target: over those that reached it). Stale drop rate: "
        "`samples_dropped.stale` / (consumed + dropped)."
        + (
            f" Async/sync speedup: mean time to target of the cell with `{SYNC_KEY}=0` and the same other values, "
            "over this cell's; a bare ratio only where every finished seed of both cells reached the target. "
            "Otherwise it says how many did, `(a/b vs c/d reached)`: a of this cell's b finished seeds, c of the "
            "synchronous cell's d; the means are over those alone, the fast seeds, so read it as favouring the "
            "cell where fewer reached. `-`: no seed of one of the two cells reached it."
            if speedup is not None
            else ""
        ),
        "",
        *_table(groups, seeds, target, speedup),
    ]
    failed = [r for r in runs if r.status == "failed"]
    if failed:
        lines += [
            "",
            "## Failed runs",
            "",
            "Invoking the sweep again reruns them.",
            "",
            *(f"* {r.cell.label}, seed {r.seed}: `{r.path.relative_to(out)}/error.txt`" for r in failed),
        ]
    lines += ["", "## Plots", "", "One line per cell: the mean over its seeds, the band from min to max.", ""]
    lines += [f"![{caption}]({name})\n" for caption, name in plots]
    return "\n".join(lines) + "\n"


def _table(
    groups: Sequence[tuple[Cell, list[RunResult]]], seeds: int, target: float | None, speedup: dict[Cell, str] | None
) -> list[str]:
    """A row per cell; a column only where some run has its data."""
    runs = [r for _, ok in groups for r in ok]
    columns = [  # (header, value of one run, format, shown)
        ("final reward", lambda r: r.summary.get("reward_end"), ".3f", True),
        (
            "held-out pass@1",
            lambda r: r.summary.get("eval.pass@1_final"),
            ".3f",
            any("eval.pass@1_final" in r.summary for r in runs),
        ),
        ("samples/s", lambda r: r.summary.get("achieved_samples_per_s"), ".1f", True),
        ("pipeline efficiency", lambda r: r.summary.get("pipeline_efficiency"), ".2f", True),
        ("stale drop rate", lambda r: r.stale_drop_rate, ".3f", True),
        ("mismatch KL", lambda r: r.mismatch_kl, ".2e", any(r.mismatch_kl is not None for r in runs)),
        ("time to target (s)", lambda r: r.reached and r.reached[0], ".1f", target is not None),
    ]
    columns = [c for c in columns if c[3]]
    header = [
        "cell",
        "runs",
        *(c[0] for c in columns),
        *(["reached target"] if target is not None else []),
        *(["async/sync speedup"] if speedup is not None else []),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell, ok in groups:
        row = [
            cell.label,
            f"{len(ok)}/{seeds}",
            *(_stat([get(r) for r in ok], fmt) for _, get, fmt, _ in columns),
            *([f"{sum(1 for r in ok if r.reached)}/{len(ok)}"] if target is not None else []),
            *([speedup[cell]] if speedup is not None else []),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines
