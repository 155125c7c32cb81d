"""The learner's host work before a step's forward: laying out its micro-batch, this tree beside another checkout.

    python bench/layout_bench.py configs/arith-smollm2.yaml --against /tmp/before \\
        --out bench/results/layout_cpu.json

``learners.packing.pack`` (with the step's micro-batching and advantages) on one step shaped like the
config's (``learner.groups_per_step`` groups of ``generator.samples_per_prompt`` rollouts to the task's own
prompts, random answers of each ``--response-tokens``), for rows padded, packed, and packed with each prompt
once. This work runs on the host while the GPU waits for its inputs, so it adds to every step whatever the
GPU. ``--against DIR`` times the same rollouts with another checkout's code (a ``git worktree`` of an
earlier commit), alternating with this tree's, each in a process of its own. ``--busy-cores N`` keeps N
other processes spinning meanwhile: a learner whose torch threads outnumber the cores left to it. Records
go to ``bench/records/layout_bench.jsonl``: milliseconds per step, this tree beside the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

LAYOUTS = {"padded": (False, False), "packed": (True, False), "prompts once": (True, True)}


def child(tree: str, rollouts_file: str, repeats: int) -> int:
    """Time each layout on the rollouts in ``rollouts_file`` with the learner of the checkout ``tree``; prints
    JSON."""
    sys.path.insert(0, tree)
    import msgspec

    import learners.packing
    from asyncrl.config import AlgoConfig
    from asyncrl.wire.protocol import Rollout
    from learners.algo import step_advantages
    from learners.packing import microbatches, pack, shared_microbatches

    assert Path(learners.packing.__file__).is_relative_to(tree), learners.packing.__file__
    batch = msgspec.json.decode(Path(rollouts_file).read_bytes(), type=list[Rollout])
    algo = AlgoConfig()

    def one_step(packed: bool, shared: bool) -> None:
        advantages = step_advantages(batch, algo, 96)
        if shared:
            rows = shared_microbatches(batch, 1 << 16)
        else:
            rows = microbatches([len(r.prompt_ids) + len(r.response_ids) for r in batch], 1 << 16, packed)
        for part in rows:
            pack([batch[i] for i in part], packed, [advantages[i] for i in part], shared=shared)

    out = {}
    for name, (packed, shared) in LAYOUTS.items():
        one_step(packed, shared)  # warm
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            one_step(packed, shared)
            seconds.append(time.perf_counter() - started)
        out[name] = [s * 1000 for s in seconds]
    print(json.dumps(out))
    return 0


def timed(tree: Path, rollouts_file: str, repeats: int) -> dict[str, list[float]]:
    cmd = [sys.executable, __file__, "--child", str(tree), rollouts_file, "--repeats", str(repeats)]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def short_commit(tree: Path) -> str:
    command = ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"]
    return subprocess.run(command, capture_output=True, text=True).stdout.strip() or str(tree)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?")
    parser.add_argument("--response-tokens", type=int, nargs="+", default=[84, 22])
    parser.add_argument("--against", type=Path, help="another checkout, timed beside this tree")
    parser.add_argument("--rounds", type=int, default=3, help="alternating processes per tree")
    parser.add_argument("--repeats", type=int, default=10, help="steps timed per process")
    parser.add_argument("--busy-cores", type=int, default=0, help="processes spinning while it measures")
    parser.add_argument("--out", default="bench/results/layout_bench.json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    records.add_argument(parser, "layout_bench")
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.repeats)

    from asyncrl.config import load_config

    config = load_config(args.config, [])
    trees = {"this tree": ROOT, **({"against": args.against.resolve()} if args.against else {})}
    commits = {name: short_commit(tree) for name, tree in trees.items()}
    results: dict[int, dict[str, dict[str, list[float]]]] = {}
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)]
    try:
        measure_all(args, config, trees, commits, results)
    finally:
        for process in spinning:
            process.kill()
    at = stamp()
    report = {"what": __doc__.split("\n")[0], "config": Path(args.config).stem, "commits": commits, "ms": results}
    report.update(machine=at.machine, date=at.date, rounds=args.rounds, repeats=args.repeats)
    report.update(
        busy_cores=args.busy_cores, rollouts=config.learner.groups_per_step * config.generator.samples_per_prompt
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    records.write(args.records, records_of(report, at))
    return 0


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Milliseconds per step of each response length and layout, this tree beside the other checkout."""
    cores = report["busy_cores"]
    busy = f" [{cores} other core{'s' if cores > 1 else ''} busy]" if cores else ""
    out = []
    for length, by_tree in report["ms"].items():
        for layout in LAYOUTS:
            other = by_tree.get("against", {}).get(layout)
            out.append(
                records.measure(
                    at,
                    bench="layout_bench",
                    case=f"{report['config']}, {length}-token answers, {layout}{busy}",
                    metric="ms_per_step",
                    unit="ms",
                    higher_is_better=False,
                    repeats=by_tree["this tree"][layout],
                    vs=records.peer(report["commits"]["against"], other, higher_is_better=False) if other else None,
                    settings={"rollouts": report["rollouts"]},
                )
            )
    return out


def measure_all(args, config, trees: dict[str, Path], commits: dict[str, str], results: dict) -> None:
    """Each response length's step, every tree in turn for ``args.rounds`` rounds, into ``results``."""
    import msgspec

    from bench.learner_step import workload

    for length in args.response_tokens:
        batch = workload(config, length, vocab_size=49152, seed=length)
        with tempfile.NamedTemporaryFile("wb", suffix=".json") as f:
            f.write(msgspec.json.encode(batch))
            f.flush()
            results[length] = {name: {} for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    for layout, ms in timed(tree, f.name, args.repeats).items():
                        results[length][name].setdefault(layout, []).extend(ms)
        for name in trees:
            medians = {layout: round(statistics.median(ms), 2) for layout, ms in results[length][name].items()}
            print(f"{length}-token answers, {name} ({commits[name]}): ms per step {medians}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
