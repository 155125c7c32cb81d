"""Several LoRA runs on one generator engine against the same runs each with its own generator, side by side.

    python bench/shared_engine.py A.yaml B.yaml --work /tmp/shared --out bench/results/shared_engine.json \\
        -- --learner.max_train_s=90

Each case starts every run at once on this machine: ``shared`` as ``asyncrl run
A.yaml B.yaml`` (a learner per run, one generator and one vLLM engine with an
adapter slot per run), ``separate`` as one ``asyncrl run`` per config (a
generator and an engine each; ``--stagger-s`` apart on a GPU, where vLLM engines profiling memory at the
same moment misjudge what is free). The overrides after ``--`` go to every run.
Reported per case: the runs' total trained samples/s (each run's
``achieved_samples_per_s``, summed), and per run its steps, reward at the
start and end (20-step means), held-out pass@1 at the start and end where the
config evaluates, pipeline efficiency, and the seconds a version took to load into the running engine
(median and 90th percentile; a shared generator loads every run's). The record is the shared case's
total samples/s beside the separate case's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.learning_run import weight_updates  # noqa: E402
from bench.provenance import stamp  # noqa: E402


def write_configs(paths: list[str], overrides: list[str], folder: Path) -> list[Path]:
    """Each config with the overrides applied and its run_dir under ``folder``, written whole."""
    from asyncrl.config import load_config, to_yaml

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        config = load_config(path, overrides)
        config.run_dir = str(folder / config.name)
        out = folder / f"{config.name}.yaml"
        out.write_text(to_yaml(config))
        written.append(out)
    return written


def run_case(
    case: str, paths: list[str], overrides: list[str], work: Path, timeout_s: float, stagger_s: float = 0.0
) -> dict[str, Any]:
    configs = write_configs(paths, overrides, work / case)
    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", "--free-ports", "--timeout-s", str(timeout_s)]
    started = time.monotonic()
    if case == "shared":
        procs = [subprocess.Popen([*command, *map(str, configs)], cwd=ROOT)]
    else:
        procs = []
        for i, config in enumerate(configs):
            if i:
                time.sleep(stagger_s)  # engines that profile GPU memory at the same moment misjudge what is free
            procs.append(subprocess.Popen([*command, str(config)], cwd=ROOT))
    codes = [p.wait(timeout=timeout_s + 60) for p in procs]
    runs = [run_result(work / case / c.stem) for c in configs]
    return {
        "exit_codes": codes,
        "wall_s": time.monotonic() - started,
        "samples_per_s": sum(r["achieved_samples_per_s"] or 0.0 for r in runs),
        "runs": runs,
    }


def run_result(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward"] for m in metrics if m.get("reward") is not None]
    evals = (
        [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
        if (run_dir / "eval.jsonl").exists()
        else []
    )
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    return {
        "run": run_dir.name,
        "steps": summary.get("steps", len(metrics)),
        "achieved_samples_per_s": summary.get("achieved_samples_per_s"),
        "pipeline_efficiency": summary.get("pipeline_efficiency"),
        "reward_start": mean(rewards[:20]),
        "reward_end": mean(rewards[-20:]),
        "pass@1_start": evals[0].get("pass@1") if evals else None,
        "pass@1_end": evals[-1].get("pass@1") if evals else None,
        # seconds per version loaded into the running engine (a shared generator's log holds every run's)
        **{k: v for k, v in weight_updates(run_dir).items() if k.startswith("load_s")},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--work", type=Path, default=Path("runs/shared_engine"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/shared_engine.json"))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument(
        "--stagger-s", type=float, default=0.0, help="separate: start each run this long after the one before"
    )
    records.add_argument(parser, "shared_engine")
    args = parser.parse_args(argv[: len(argv) - len(overrides) - (1 if overrides else 0)])
    cases = {
        case: run_case(case, args.configs, overrides, args.work, args.timeout_s, args.stagger_s)
        for case in ("shared", "separate")
    }
    at = stamp(commit=args.commit)
    report = {
        "what": __doc__.split("\n")[0],
        "configs": args.configs,
        "overrides": overrides,
        "cases": cases,
        "machine": at.machine,
        "date": at.date,
        "commit": at.commit,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for case, result in cases.items():
        print(
            case,
            f"{result['samples_per_s']:.1f} samples/s",
            [
                (
                    r["run"],
                    r["reward_start"],
                    r["reward_end"],
                    r["pass@1_start"],
                    r["pass@1_end"],
                    r.get("load_s_median"),
                )
                for r in result["runs"]
            ],
        )
    if all(code == 0 for result in cases.values() for code in result["exit_codes"]):
        records.write(args.records, records_of(report, at))
    return 0


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """The shared engine's total samples/s beside the separate engines'."""
    names = " + ".join(Path(c).stem for c in report["configs"])
    separate = records.peer("an engine per run", [report["cases"]["separate"]["samples_per_s"]])
    return [
        records.measure(
            at,
            bench="shared_engine",
            case=names + "".join(f" {o}" for o in report["overrides"]),
            metric="samples_per_s",
            unit="samples/s",
            repeats=[report["cases"]["shared"]["samples_per_s"]],
            vs=separate,
            settings={"runs": [r["run"] for r in report["cases"]["shared"]["runs"]]},
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
