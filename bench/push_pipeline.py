"""Blocking vs background weight push, in the running pipeline, side by side.

Runs ``asyncrl run`` twice on the same config, pushing every version over the
process group (gloo on CPU, NCCL on GPU), with ``push.background`` off and on.
It reports samples/s, the learner's time per publish (what training waits for)
and the push's own time, from the learner's log.

    python bench/push_pipeline.py --config configs/ci-tiny.yaml --out bench/results/push_pipeline_cpu.json

Also appends the background push's figures beside the blocking one's to
``bench/records/push_pipeline.jsonl`` (one run of each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/ci-tiny.yaml"))
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench/results/push_pipeline_cpu.json")
    records.add_argument(parser, "push_pipeline")
    args = parser.parse_args()

    from asyncrl.launch import local
    from asyncrl.observe.metrics import read_metrics

    results = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"),
        "config": args.config,
        "generators": args.generators,
        "steps": args.steps,
        "max_new_tokens": args.max_new_tokens,
        "runs": {},
    }
    pattern = re.compile(r"pushed v\d+: .* ([0-9.]+) s$")
    for background in (False, True):
        run_dir = Path(f"/tmp/asyncrl-push-pipeline-{background}")
        shutil.rmtree(run_dir, ignore_errors=True)
        summary = local.run(
            args.config,
            [
                "--push.address=127.0.0.1:1",
                f"--push.generators={args.generators}",
                f"--push.background={str(background).lower()}",
                f"--generator.replicas={args.generators}",
                f"--learner.total_steps={args.steps}",
                f"--generator.max_new_tokens={args.max_new_tokens}",
            ],
            str(run_dir),
            free_ports=True,
            timeout_s=600,
            quiet=True,
        )
        publish = [r["publish_s"] for r in read_metrics(run_dir)]
        pushes = [
            float(m.group(1))
            for line in (run_dir / "logs/learner.log").read_text().splitlines()
            if (m := pattern.search(line))
        ]
        results["runs"]["background" if background else "blocking"] = {
            "samples_per_s": summary["achieved_samples_per_s"],
            "pipeline_efficiency": summary["pipeline_efficiency"],
            "learner_publish_s_median": statistics.median(publish),
            "push_s_median": statistics.median(pushes),
            "pushes": len(pushes),
            "reward_start": summary["reward_start"],
            "reward_end": summary["reward_end"],
        }
        print(json.dumps(results["runs"]), flush=True)
    runs = results["runs"]
    results["speedup_samples_per_s"] = runs["background"]["samples_per_s"] / runs["blocking"]["samples_per_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    from bench.provenance import stamp

    records.write(args.records, records_of(results, stamp()))


def records_of(results: dict, at: records.Stamp) -> list[records.Record]:
    """The background push beside the blocking one, one run each: samples/s, the learner's time per publish,
    and the push's own time."""
    runs = results["runs"]
    settings = {key: results[key] for key in ("generators", "steps", "max_new_tokens")}
    case = f"{Path(results['config']).stem}, {results['generators']} generators"
    return [
        records.measure(
            at,
            bench="push_pipeline",
            case=case,
            metric=key,
            unit=unit,
            repeats=[runs["background"][key]],
            higher_is_better=better,
            vs=records.peer("blocking push", [runs["blocking"][key]], better),
            settings=settings,
        )
        for key, unit, better in (
            ("samples_per_s", "samples/s", True),
            ("learner_publish_s_median", "s", False),
            ("push_s_median", "s", False),
        )
    ]


if __name__ == "__main__":
    main()
