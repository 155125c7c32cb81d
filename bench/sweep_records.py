"""Records from an ``asyncrl sweep`` folder: each grid cell's figures over its seeds, async cells beside sync.

    asyncrl sweep configs/copy-cpu.yaml --grid staleness.max_staleness=0,2,8 --grid algo.off_policy=none,tis \
        --seeds 2 --target-reward 0.6 --out DIR
    python bench/sweep_records.py DIR [--bench staleness_sweep]

reads ``DIR/sweep.json`` (the grid) and ``DIR/sweep.csv`` (one row per run) and appends, per cell: time to
the target reward and the steps it took (a seed that never reached it counts as the slowest), samples/s and
the final held-out pass@1. Where the grid has ``staleness.max_staleness``, a cell is measured beside the
synchronous cell (0) with the same other values.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402

STALENESS = "staleness.max_staleness"
# Columns of sweep.csv recorded per cell: (column, metric, unit, higher is better).
COLUMNS = (
    ("time_to_target_s", "time_to_target_s", "s", False),
    ("steps_to_target", "steps_to_target", "steps", False),
    ("achieved_samples_per_s", "samples_per_s", "samples/s", True),
    ("eval.pass@1_final", "pass@1_final", "pass@1", True),
)


def _number(text: str) -> float | None:
    return float(text) if text not in ("", "None", "nan") else None


def records_of(sweep: dict, rows: list[dict[str, str]], at: records.Stamp, bench: str) -> list[records.Record]:
    """Each cell's figures over its seeds (in seed order), async cells beside the sync cell of the same others."""
    keys = [key for key, _ in sweep["grids"]]
    cells: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for row in sorted(rows, key=lambda r: int(r["seed"])):
        cells.setdefault(tuple(row[key] for key in keys), []).append(row)
    settings = {"config": sweep["config"], "target_reward": sweep.get("target_reward"), "grid": keys}
    out = []
    for cell, runs in cells.items():
        sync = None
        if STALENESS in keys and cell[keys.index(STALENESS)] != "0":
            sync = cells.get(tuple("0" if key == STALENESS else value for key, value in zip(keys, cell)))
        case = ", ".join(f"{key.split('.')[-1]}={value}" for key, value in zip(keys, cell))
        for column, metric, unit, better in COLUMNS:
            out.append(
                records.measure(
                    at,
                    bench=bench,
                    case=case,
                    metric=metric,
                    unit=unit,
                    higher_is_better=better,
                    repeats=[_number(r[column]) for r in runs],
                    vs=records.peer("sync", [_number(r[column]) for r in sync], better) if sync else None,
                    seeds=[int(r["seed"]) for r in runs],
                    settings=settings,
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    """Appends a sweep folder's records (commit, date and machine: this checkout and machine unless given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the sweep's --out folder")
    parser.add_argument("--bench", default="staleness_sweep")
    parser.add_argument("--commit", default=None, help="the commit the sweep ran (default: the checkout's HEAD)")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--machine", default=None, help="default: this machine")
    parser.add_argument("--records", default=None, help="default: bench/records/BENCH.jsonl ('none': print only)")
    args = parser.parse_args(argv)
    from bench.provenance import short_commit, short_machine

    at = records.Stamp(
        commit=args.commit or short_commit(), date=args.date, machine=args.machine or short_machine(gpu=False)
    )
    sweep = json.loads((args.folder / "sweep.json").read_text())
    with (args.folder / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    found = records_of(sweep, rows, at, args.bench)
    for record in found:
        print(record.case, record.metric, record.value, flush=True)
    records.write(args.records or records.FOLDER / f"{args.bench}.jsonl", found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
