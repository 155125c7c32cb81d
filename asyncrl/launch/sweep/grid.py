"""The grid of an ``asyncrl sweep``: its cells (one value per gridded key) and where each (cell, seed) run lives."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError

SEED_KEYS = ("learner.seed", "generator.seed")  # the prompt order follows learner.seed; eval sets stay fixed
RESERVED_KEYS = ("run_dir", *SEED_KEYS)  # set by the sweep for every run
SYNC_KEY = "staleness.max_staleness"
SMOOTH_STEPS = 10  # time to target: the reward's running mean over this many steps

Grid = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class Cell:
    """One point of the grid: ``((dotted key, value as typed), ...)`` in ``--grid`` order."""

    values: tuple[tuple[str, str], ...]

    @property
    def overrides(self) -> list[str]:
        return [f"--{key}={value}" for key, value in self.values]

    def _names(self) -> list[str]:
        """Leaf key names (``max_staleness``), or the dotted key where two grids share a leaf."""
        leaves = [key.rsplit(".", 1)[-1] for key, _ in self.values]
        return [leaf if leaves.count(leaf) == 1 else key for leaf, (key, _) in zip(leaves, self.values)]

    @property
    def label(self) -> str:
        return ", ".join(f"{n}={v}" for n, (_, v) in zip(self._names(), self.values)) or "base"

    @property
    def slug(self) -> str:
        """The cell's folder name under ``OUT/runs``: ``max_staleness-2__off_policy-tis``.

        Only characters a ``file://`` URI leaves as they are: weight versions are announced as
        URIs of folders in the run dir, and an escaped ``=`` does not find its way back.
        """
        return (
            "__".join(f"{n}-{re.sub(r'[^A-Za-z0-9._-]', '_', v)}" for n, (_, v) in zip(self._names(), self.values))
            or "base"
        )


def parse_grid(spec: str) -> Grid:
    """``"staleness.max_staleness=0,1,2"`` -> ``("staleness.max_staleness", ("0", "1", "2"))``."""
    key, sep, values = spec.partition("=")
    key = key.strip().removeprefix("--")
    items = tuple(v.strip() for v in values.split(","))
    if not sep or not key or not all(items):
        raise ConfigError(f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. staleness.max_staleness=0,1,2)")
    if len(set(items)) != len(items):
        raise ConfigError(f"--grid {spec!r}: a value is listed twice")
    if key in RESERVED_KEYS:
        raise ConfigError(f"--grid {spec!r}: {key} is set by the sweep itself (--seeds, --out)")
    return key, items


def make_cells(grids: Sequence[Grid]) -> list[Cell]:
    """The cartesian product of the grids, first grid slowest."""
    keys = [key for key, _ in grids]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ConfigError(f"--grid {twice[0]} is given twice: list all its values in one --grid")
    cells = [Cell(tuple(zip(keys, combo))) for combo in itertools.product(*(values for _, values in grids))]
    clash = [slug for slug, n in Counter(c.slug for c in cells).items() if n > 1]
    if clash:
        raise ConfigError(
            f"two cells would share the folder runs/{clash[0]}: their values differ only in "
            "characters that are replaced in folder names"
        )
    return cells


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys: ``{"eval": {"pass@1_final": 0.5}}`` -> ``{"eval.pass@1_final": 0.5}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run_path(out: Path, cell: Cell, seed: int) -> Path:
    """The run dir of one (cell, seed): ``OUT/runs/<cell slug>/seed<seed>``; the report reads runs back from it."""
    return Path(out) / "runs" / cell.slug / f"seed{seed}"


def finished(path: Path) -> bool:
    """Whether the run in ``path`` ended well: ``asyncrl run`` completed its ``summary.json`` (``total_wall_s``,
    added once every process stopped) and nothing failed after (``error.txt``). Its learner writes the file
    first, so a run the sweep was interrupted in (Ctrl-C, SIGTERM) may hold the learner's part alone."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (FileNotFoundError, ValueError):  # none, or cut off mid-write
        return False
    return "total_wall_s" in summary and not (path / "error.txt").exists()
