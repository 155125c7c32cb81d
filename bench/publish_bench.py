"""How long publishing a version holds up the learner: folder written in the step vs on its own thread.

The learner's publisher writes each version as an HF folder and announces
it. With ``learner.background_publish`` (the default) the step waits only
for the CPU copy of the weights, and a thread writes the folder while the
next step trains; without it the step waits for the write as well. This runs
both, side by side, on one model: ``--versions`` publishes, each followed by
a stand-in training step of ``--step-s`` seconds (a sleep, so the write
competes with nothing but itself), and reports per publish the seconds the
learner was held up and the write's own seconds.

    asyncrl model import smollm2-135m models/smollm2-135m
    python bench/publish_bench.py --model models/smollm2-135m --out bench/results/publish_bench.json

Also appends the background write's figures over the rounds (each round's
median), beside the write in the step, to ``bench/records/publish_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402


class Announcements:
    """Stands in for the coordinator: what generators would be told, and when."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    def publish(self, update) -> None:
        self.versions.append(update.version)


def measure(model, model_path: str, background: bool, versions: int, step_s: float, work: Path) -> dict:
    from asyncrl.config import load_config
    from learners.publisher import Publisher

    config = load_config(
        None,
        [
            f"run_dir={work}",
            f"model.path={model_path}",
            f"learner.background_publish={str(background).lower()}",
            "learner.keep_versions=2",
        ],
    )
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, work / "weights")
    held, writes = [], []
    started = time.monotonic()
    for version in range(1, versions + 1):
        held.append(publisher.publish(version))
        time.sleep(step_s)  # the next training step, which a background write overlaps
        if publisher.last_write_s is not None:
            writes.append(publisher.last_write_s)
    publisher.finish()
    total = time.monotonic() - started
    assert coordinator.versions == list(range(1, versions + 1)), coordinator.versions
    return {
        "background_publish": background,
        "held_s_median": statistics.median(held[1:]),
        "held_s": [round(h, 4) for h in held],
        "write_s_median": statistics.median(writes[1:] or writes),
        "total_s": total,
        "per_version_s": total / versions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/smollm2-135m"), help="HF folder")
    parser.add_argument("--versions", type=int, default=8, help="per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    parser.add_argument("--step-s", type=float, default=1.0, help="the stand-in training step between publishes")
    parser.add_argument("--work", type=Path, default=None, help="where versions are written (default: a temp dir)")
    parser.add_argument("--out", type=Path, required=True)
    records.add_argument(parser, "publish_bench")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    work = args.work or Path(tempfile.mkdtemp(prefix="asyncrl-publish-"))
    runs = []
    for round_ in range(args.rounds):  # the modes alternate, so a slow spell of the machine hits both
        for background in (False, True):
            folder = work / f"round{round_}-{'background' if background else 'in-step'}"
            shutil.rmtree(folder, ignore_errors=True)
            runs.append({"round": round_, **measure(model, args.model, background, args.versions, args.step_s, folder)})
            shutil.rmtree(folder, ignore_errors=True)
            row = runs[-1]
            print(
                f"round {round_}, background_publish={background}: learner held {row['held_s_median']:.3f} s "
                f"per publish, write {row['write_s_median']:.3f} s, {row['per_version_s']:.3f} s per version",
                flush=True,
            )

    def median_of(background: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["background_publish"] == background)

    medians = {
        mode: {key: median_of(background, key) for key in ("held_s_median", "write_s_median", "per_version_s")}
        for mode, background in (("in_step", False), ("background", True))
    }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "learner time held up per published version: folder written in the step vs on its own thread",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}",
        "commit": commit,
        "model": args.model,
        "model_bytes": num_bytes,
        "versions": args.versions,
        "step_s": args.step_s,
        "rounds": args.rounds,
        "runs": runs,
        "medians": medians,
        "held_ratio_background_over_in_step": medians["background"]["held_s_median"]
        / medians["in_step"]["held_s_median"],
        "per_version_ratio_background_over_in_step": medians["background"]["per_version_s"]
        / medians["in_step"]["per_version_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"learner held up {report['held_ratio_background_over_in_step']:.2f}x as long with the background write; "
        f"wrote {args.out}"
    )
    from bench.provenance import stamp

    records.write(args.records, records_of(report, stamp(gpu=False)))
    return 0


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Per round, with the folder written on a thread beside written in the step: learner held per publish,
    the write itself, and the wall-clock per version with the stand-in step."""

    def rounds(background: bool, key: str) -> list[float]:
        return [r[key] for r in report["runs"] if r["background_publish"] is background]

    settings = {key: report[key] for key in ("model_bytes", "versions", "step_s", "rounds")}
    return [
        records.measure(
            at,
            bench="publish_bench",
            case=f"{Path(report['model']).name}, fp32",
            metric=metric,
            unit="s",
            repeats=rounds(True, key),
            higher_is_better=False,
            vs=records.peer("write in the step", rounds(False, key), higher_is_better=False),
            settings=settings,
        )
        for metric, key in (
            ("held_s", "held_s_median"),
            ("write_s", "write_s_median"),
            ("per_version_s", "per_version_s"),
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
