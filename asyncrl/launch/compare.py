"""``asyncrl run --compare-sync``: a config run as given and synchronously, and the speedup between them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.launch.local import run
from asyncrl.observe.metrics import read_metrics, scored


def compare_sync(
    config_path: str, overrides: list[str], run_dir: str | None, free_ports: bool, timeout_s: float, quiet: bool = False
) -> dict[str, Any]:
    """Run the config as given and again with ``max_staleness=0``; report the speedup."""
    base = Path(run_dir or load_config(config_path, overrides).run_dir)
    runs = {}
    for label, extra in (("async", []), ("sync", ["--staleness.max_staleness=0"])):
        runs[label] = run(config_path, overrides + extra, str(base / label), free_ports, timeout_s, quiet)
    a, s = runs["async"], runs["sync"]
    result = {
        "async": a,
        "sync": s,
        "speedup_samples_per_s": a["achieved_samples_per_s"] / s["achieved_samples_per_s"],
        "wall_ratio_sync_over_async": s["wall_s"] / a["wall_s"],
    }
    (base / "compare.json").write_text(json.dumps(result, indent=2))
    _plot_compare(base, runs)
    return result


def _plot_compare(base: Path, runs: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl.observe.metrics import smooth

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, summary in runs.items():
        records = scored(read_metrics(summary["run_dir"]))
        ax.plot(
            [r["wall_s"] for r in records],
            smooth([r["reward"] for r in records]),
            label=f"{label} (max_staleness={summary['max_staleness']})",
        )
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("mean reward (smoothed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(base / "compare.png", dpi=110)
    plt.close(fig)
