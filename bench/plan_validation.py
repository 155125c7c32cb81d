"""``asyncrl plan``'s simulation against real runs: predicted pipeline efficiency and staleness beside measured.

    python bench/plan_validation.py                       # the CPU quickstart with 1, 2 and 3 generators
    python bench/plan_validation.py --generators 2 --seeds 0 1 2 --records none
    python bench/plan_validation.py --runs /tmp/plan_validation/quickstart-1 --label "machine loaded" --notes ...

Each case runs ``configs/quickstart.yaml`` with ``generator.replicas`` N, then
feeds the simulation what that run's own folder measured (summary.json's
capacities, the lengths, the step-time spread, the version loads) and plays
it with several seeds. The committed one-GPU SmolLM2 run
(``bench/results/arith_smollm2_h200``) is validated the same way, from its
folder alone: its answers' length phases and the learner's fixed share of a
step from ``metrics.jsonl``, its evaluations from ``config.yaml``. Records:
the predicted efficiency and mean staleness (over the simulation's seeds)
with the measured run as the peer, and the total variation between the two
staleness histograms (the share of samples that would have to move; 0.10 is
the target). Before each run the script waits,
up to ``--max-wait-s``, for the machine's load to fall below 1.5, and notes
the load it started at.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from asyncrl.launch.plan.model import simulate  # noqa: E402
from asyncrl.launch.plan.rates import Measured, read_run  # noqa: E402
from asyncrl.launch.plan.report import total_variation  # noqa: E402
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

BENCH = "plan_validation"
SMOLLM2 = ROOT / "bench" / "results" / "arith_smollm2_h200"


def wait_for_quiet(limit: float, max_wait_s: float) -> float:
    """The 1-minute load average once it is below ``limit``, or after ``max_wait_s`` (whatever it is then)."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def quickstart(generators: int, work: Path, timeout_s: float) -> Path:
    """One quickstart run with ``generators`` generators; its folder."""
    run_dir = work / f"quickstart-{generators}"
    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", "configs/quickstart.yaml"]
    command += ["--run-dir", str(run_dir), "--free-ports", "--generator.replicas", str(generators)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    return run_dir


def mean_staleness(histogram: dict[int, float]) -> float:
    return sum(s * p for s, p in histogram.items())


def case_records(at: records.Stamp, case: str, measured: Measured, seeds: list[int], notes: str) -> list:
    """The three records of one case: efficiency, mean staleness and the histograms' distance."""
    pipe = measured.pipeline
    steps = 600
    predictions = [simulate(pipe, steps, seed) for seed in seeds]
    settings = {
        "generators": pipe.generators,
        "max_staleness": pipe.max_staleness,
        "engine": "streaming" if pipe.streaming else "batch",
        "simulated_steps": steps,
        "inputs": measured.sources,
        "measured_staleness": measured.staleness,
        "predicted_staleness": [p.staleness for p in predictions],
    }
    common = {"bench": BENCH, "case": case, "seeds": seeds, "settings": settings, "notes": notes}
    efficiency = records.measure(
        at,
        metric="pipeline_efficiency",
        unit="of the slower side",
        repeats=[p.pipeline_efficiency for p in predictions],
        vs=records.peer("measured", [measured.pipeline_efficiency]),
        **common,
    )
    staleness = records.measure(
        at,
        metric="staleness_mean",
        unit="versions",
        higher_is_better=False,
        repeats=[mean_staleness(p.staleness) for p in predictions],
        vs=records.peer("measured", [mean_staleness(measured.staleness)], higher_is_better=False),
        **common,
    )
    distance = records.measure(
        at,
        metric="staleness_total_variation",
        unit="share of samples",
        higher_is_better=False,
        repeats=[total_variation(p.staleness, measured.staleness) for p in predictions],
        **common,
    )
    for record in (efficiency, staleness, distance):
        ratio = f"{record.vs.ratio:.2f}x measured" if record.vs else ""
        print(f"{case} {record.metric}: predicted {record.value:.3f} {ratio}", flush=True)
    return [efficiency, staleness, distance]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the simulation's seeds")
    parser.add_argument("--work", default="/tmp/plan_validation", help="where the quickstart runs go")
    parser.add_argument("--max-wait-s", type=float, default=180.0, help="wait at most this long for a quiet machine")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per quickstart run")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument(
        "--runs", nargs="+", default=None, help="quickstart run folders made already, checked instead of new runs"
    )
    parser.add_argument("--notes", default="", help="with --runs: how they ran (the load at their start)")
    parser.add_argument("--label", default="", help="with --runs: appended to each case's name")
    records.add_argument(parser, BENCH)
    args = parser.parse_args()
    out = []
    for run_dir in args.runs or []:
        measured = read_run(run_dir)
        generators = measured.pipeline.generators
        case = f"quickstart, {generators} generator" + ("s" if generators > 1 else "")
        case += f", {args.label}" if args.label else ""
        out += case_records(stamp(gpu=False), case, measured, args.seeds, args.notes)
    for generators in [] if args.runs else args.generators:
        load = wait_for_quiet(1.5, args.max_wait_s)
        run_dir = quickstart(generators, Path(args.work), args.timeout_s)
        notes = (
            f"1-minute load {load:.2f} at the start (2 cores shared with other work); rates, lengths, step-time "
            "spread and version loads read from the run's own folder"
        )
        case = f"quickstart, {generators} generator" + ("s" if generators > 1 else "")
        out += case_records(stamp(gpu=False), case, read_run(run_dir), args.seeds, notes)
    if not args.skip_smollm2:
        # The run predates generators that stream (1085ec6): its vLLM generator sampled a request at a time and
        # answered an evaluation piece (50 prompts: a greedy batch, then 8 samples each) before a request's groups.
        notes = (
            "the committed run folder (2026-12-01, 0d57d42, one H200 shared by four runs side by side, each with "
            "its generator and learner); simulated as a batch engine, which it was then, with its answers' length "
            "in 20 phases (87 tokens to 17), the learner's step 61% fixed (fitted on tokens) and each evaluation "
            "as 4 pieces of 50 prompts, each a greedy and a sampled batch before a request; lengths lognormal "
            "(sigma 0.8) within a phase; simulated on this machine"
        )
        at = stamp(gpu=False)
        out += case_records(at, "arith-smollm2, one H200 shared", read_run(SMOLLM2, streaming=False), args.seeds, notes)
    records.write(args.records, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
