"""Assert from the quickstart's summary.json and metrics.jsonl that it ran every step, that reward rose and that
every step's loss and gradient norm are finite."""

import json
import math
import re
import sys
from pathlib import Path

import yaml

command = sys.argv[1]
run_dir = re.search(r"--run-dir\s+(\S+)", command).group(1)
summary = json.loads((Path(run_dir) / "summary.json").read_text())
start, end = summary["reward_start"], summary["reward_end"]
print(f"quickstart: {summary['steps']} steps, reward {start:.3f} -> {end:.3f}, {summary['total_wall_s']:.0f}s")
total = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())["learner"]["total_steps"]
assert summary["steps"] == total, f"ran {summary['steps']} of {total} steps"
assert end >= start + 0.3, f"reward did not rise: {start:.3f} -> {end:.3f}"
records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
bad = [r["step"] for r in records if not all(map(math.isfinite, (r["loss"], r["grad_norm"])))]
assert not bad, f"loss or grad_norm not finite at steps {bad[:5]}"
