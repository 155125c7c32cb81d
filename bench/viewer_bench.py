"""How fast ``asyncrl view`` opens a long run's folder, and how much memory it holds.

Writes a synthetic run folder the size of a long run (``--steps`` steps of
``--samples`` rollouts each in consumed.jsonl, ``--kept`` rollouts a step
of ``--tokens`` tokens each in rollouts.jsonl), then, in a fresh process per
repeat, asks the viewer's API for the curves and the rollout list as the page
does: the first answer (every line parsed), the next (only what was
appended), and the memory the process holds after. Appends the medians to
``bench/records/viewer_bench.jsonl``.

    python bench/viewer_bench.py --out /tmp/viewer-run
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

PROBE = """
import json, sys, time
import psutil
from fastapi.testclient import TestClient
from asyncrl.launch.viewer.server import make_app
process = psutil.Process()
before = process.memory_info().rss
client = TestClient(make_app(sys.argv[1]), base_url="http://127.0.0.1")
out = {}
for name, path in (("curves", "/api/curves"), ("rollouts", "/api/rollouts")):
    for when in ("first", "next"):
        started = time.perf_counter()
        assert client.get(path).status_code == 200
        out[f"{name}_{when}_s"] = time.perf_counter() - started
out["held_mb"] = (process.memory_info().rss - before) / 1e6
print(json.dumps(out))
"""


def write_run(folder: Path, steps: int, samples: int, kept: int, tokens: int) -> dict[str, float]:
    """A run folder of that size; the MB of each file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    rng = random.Random(0)
    with (folder / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            record = {"step": s, "reward": s / steps, "wall_s": s * 0.1, "samples": samples}
            f.write(json.dumps(record | {"generated_samples": samples * s, "staleness_mean": 0.5}) + "\n")
    with (folder / "consumed.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            f.writelines(
                json.dumps({"id": f"g{s}-{i}", "step": s, "staleness": i % 2, "prompt": i, "generator": "gen-0"}) + "\n"
                for i in range(samples)
            )
    with (folder / "rollouts.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            for k in range(kept):
                ids = [rng.randrange(32000) for _ in range(tokens)]
                logprobs = [round(-rng.random(), 4) for _ in range(tokens)]
                record = {"step": s, "version": s, "id": f"g{s}-{k}", "group": f"g{s}", "prompt_index": k}
                record |= {"reward": rng.random(), "staleness": k % 2, "finish_reason": "stop", "drop_reason": None}
                record |= {"prompt_ids": list(range(64)), "response_ids": ids, "logprobs": logprobs}
                record |= {"versions": [s] * tokens, "loss_mask": [1] * tokens, "advantages": [0.5] * tokens}
                f.write(json.dumps(record | {"learner_logprobs": logprobs}) + "\n")
    return {p.name: p.stat().st_size / 1e6 for p in folder.iterdir() if p.suffix == ".jsonl"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the synthetic run folder")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=256, help="rollouts trained per step")
    parser.add_argument("--kept", type=int, default=8, help="rollouts kept per step (rollouts.jsonl)")
    parser.add_argument("--tokens", type=int, default=512, help="response tokens of each kept rollout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--records", type=Path, default=records.FOLDER / "viewer_bench.jsonl")
    args = parser.parse_args(argv)
    sizes = write_run(args.out, args.steps, args.samples, args.kept, args.tokens)
    runs = []
    for _ in range(args.repeats):
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, str(args.out)], capture_output=True, text=True, check=True, cwd=ROOT
        )
        runs.append(json.loads(probe.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    at = stamp()
    case = f"{args.steps} steps x {args.samples} rollouts, {args.kept} kept x {args.tokens} tokens"
    settings = vars(args) | {"file_mb": {k: round(v, 1) for k, v in sizes.items()}}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    metrics = [
        ("curves_first_s", "s"),
        ("curves_next_s", "s"),
        ("rollouts_first_s", "s"),
        ("rollouts_next_s", "s"),
        ("held_mb", "MB"),
    ]
    out = [
        records.measure(
            at,
            bench="viewer_bench",
            case=case,
            metric=metric,
            unit=unit,
            repeats=[r[metric] for r in runs],
            higher_is_better=False,
            settings=settings,
        )
        for metric, unit in metrics
    ]
    records.write(args.records, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
