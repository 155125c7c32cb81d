"""``asyncrl``: run a job on this machine, watch a running job, make keys.

    asyncrl run CONFIG [--run-dir DIR] [--compare-sync] [--ray [--ray-address ADDR]] [--key.sub VALUE ...]
    asyncrl scale RUN_DIR --generators N
    asyncrl sweep CONFIG --grid KEY=V1,V2 [--grid ...] --seeds N --out DIR [-- --key.sub VALUE ...]
    asyncrl status CONFIG [--watch]
    asyncrl eval CONFIG --weights DIR
    asyncrl view RUN_DIR [RUN_DIR ...]
    asyncrl plan --from RUN_DIR [--gpus N --hosts H --link-gbps G ...]
    asyncrl keys PATH

Heavy modules are imported inside each command, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import describe_keys, load_config, on_or_off, positive_seconds
from asyncrl.launch import plan, status, viewer


def main(argv: list[str] | None = None) -> int:
    from asyncrl.config import ConfigError

    args, overrides = _parser().parse_known_args(argv)
    if args.command in ("run", "sweep"):
        from asyncrl.launch.processes import interrupt_on_sigterm

        interrupt_on_sigterm()
    try:
        return COMMANDS[args.command](args, overrides)
    except (ConfigError, TimeoutError, RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"asyncrl {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(
            f"asyncrl {args.command}: stopped ({exc or 'Ctrl-C'}); the processes it started were stopped too",
            file=sys.stderr,
        )
        return 130


def _parser() -> argparse.ArgumentParser:
    """The ``asyncrl`` command line: one sub-command per job."""
    from asyncrl.launch.sweep.runner import add_parser as add_sweep_parser

    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    scale = sub.add_parser("scale", help="add or remove generators of a running `asyncrl run --ray`")
    scale.add_argument("run_dir")
    scale.add_argument("--generators", type=int, required=True, help="how many generators to run from now on")
    scale.add_argument(
        "--timeout-s", type=positive_seconds, default=600.0, help="wait this long for the pool to reach N"
    )
    add_sweep_parser(sub)
    _add_watching(sub)
    viewer.add_parser(sub)
    plan.add_parser(sub)
    keys = sub.add_parser("keys", help="create the CURVE certificate a run's processes share")
    keys.add_argument("path", help="e.g. secrets/run (writes run.key and run.key_secret)")
    model = sub.add_parser("model", help="import a small real model as an HF folder (asyncrl model list)")
    model_actions = model.add_subparsers(dest="action", required=True)
    model_actions.add_parser("list", help="the models that can be imported, and whether their package is installed")
    model_import = model_actions.add_parser("import", help="write NAME as an HF folder at DIR (no-op if already there)")
    model_import.add_argument("name", help="a name from `asyncrl model list`, e.g. smollm2-135m")
    model_import.add_argument("dir", help="the HF folder to write")
    return parser


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="start learner, generators and buffer on this machine",
        epilog=describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "config",
        nargs="+",
        help="run config (YAML); several: LoRA runs of one base that share one generator and its engine",
    )
    run.add_argument("--run-dir", default=None, help="where outputs go (default: run_dir in the config)")
    run.add_argument(
        "--compare-sync", action="store_true", help="also run with max_staleness=0 and report the async/sync speedup"
    )
    run.add_argument("--free-ports", action="store_true", help="pick free loopback ports for this run")
    run.add_argument("--view", type=int, metavar="PORT", default=None, help="serve `asyncrl view` while it runs")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its newest checkpoint (learner.checkpoint_every_steps)",
    )
    run.add_argument("--timeout-s", type=positive_seconds, default=3600.0, help="give up after this long")
    run.add_argument(
        "--trace",
        nargs="?",
        const=True,
        default=False,
        type=on_or_off,
        help="write a timeline of every process to RUN_DIR/trace.json (open it at ui.perfetto.dev); "
        "--trace=true and --trace=false as the config key takes them",
    )
    run.add_argument(
        "--ray",
        action="store_true",
        help="place the learner ranks and generators as Ray actors, which Ray restarts (ray.* keys)",
    )
    run.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (default: RAY_ADDRESS; with neither, start a local instance)",
    )


def _add_watching(sub: argparse._SubParsersAction) -> None:
    """The commands that look at a run or a saved version: status, eval, trace."""
    status = sub.add_parser(
        "status",
        help="show a running learner's state",
        epilog=describe_keys(["coordinator"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_argument("config")
    status.add_argument("--address", default=None, help="control endpoint (default: coordinator.address)")
    status.add_argument("--watch", action="store_true", help="refresh every second until interrupted")
    status.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    evaluate = sub.add_parser("eval", help="held-out pass@1 and pass@k of a saved version (HF folder)")
    evaluate.add_argument("config")
    evaluate.add_argument("--weights", required=True, help="a published version (RUN_DIR/weights/vNNNNNN) or an export")
    evaluate.add_argument("--out", default=None, help="traces as JSONL (default: WEIGHTS/eval.jsonl)")
    evaluate.add_argument(
        "--timeout-s",
        type=positive_seconds,
        default=3600.0,
        help="give up after this long, engine start-up included (default: 3600)",
    )
    trace = sub.add_parser(
        "trace",
        help="merge the per-process timelines of a run (trace: true) into one file "
        "and print where each process spent its time",
    )
    trace.add_argument("run_dir")


def _sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.launch.sweep.runner import command

    return command(args, overrides)


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    # Generation lives in generators/, which this package never imports: run it as its own process.
    from asyncrl.launch.processes import call_within

    out = ["--out", args.out] if args.out else []
    command = [sys.executable, "-m", "generators.evaluate", args.config, "--weights", args.weights, *out, *overrides]
    return call_within(command, args.timeout_s, "asyncrl eval")


def _scale(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.launch.ray.scaling import scale as scale_pool

    pool = scale_pool(args.run_dir, args.generators, args.timeout_s)
    running = [f"{name} on {g.node} (pid {g.pid})" for name, g in pool.generators.items() if g.state == "running"]
    print(f"{args.generators} generator(s) running: " + ", ".join(running))
    return 0


def _trace(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.observe.trace import merge

    out = merge(args.run_dir)
    if out is None:
        print(f"asyncrl trace: no {args.run_dir}/trace/*.json: was the run started with trace: true?", file=sys.stderr)
        return 1
    _print_timeline(out)
    return 0


def _model(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.launch.models import command

    return command(args, overrides)


def _keys(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.wire.sockets import create_certificate

    print(f"secret: {create_certificate(args.path)} (share it with every process of the run)")
    return 0


def _run_shared(args: argparse.Namespace, overrides: list[str]) -> int:
    """``asyncrl run A.yaml B.yaml``: the runs side by side, one generator serving them all."""
    from asyncrl.launch import local

    flags = (("--run-dir", args.run_dir), ("--compare-sync", args.compare_sync), ("--resume", args.resume))
    for flag, given in flags:
        if given:
            raise ValueError(f"{flag} is for one run; runs that share a generator each use their config's run_dir")
    if args.ray:
        raise ValueError("--ray: runs that share a generator run on this machine; leave out --ray")
    if args.view is not None:  # one page for all of them, a run picker at its top
        viewer.start_for_run([load_config(config, overrides).run_dir for config in args.config], args.view)
    for summary in local.run_shared(args.config, overrides, args.free_ports, args.timeout_s):
        _print_summary(summary["run_dir"], summary)
    return 0


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.launch import compare, local

    if args.trace:  # with its dashes: in a generator's command line a bare KEY=VALUE would be read as a config
        overrides = [*overrides, "--trace=true"]
    if len(args.config) > 1:
        return _run_shared(args, overrides)
    [args.config] = args.config
    if args.ray_address and not args.ray:
        raise ValueError("--ray-address needs --ray")
    if args.view is not None and (args.ray or args.compare_sync):
        raise ValueError("--view serves one local run: with --ray or --compare-sync, `asyncrl view RUN_DIR` instead")
    if args.ray:
        if args.compare_sync:
            raise ValueError("--compare-sync runs on this machine: leave out --ray")
        from asyncrl.launch.ray import driver

        summary = driver.run(
            args.config, overrides, args.run_dir, args.free_ports, args.timeout_s, args.ray_address, resume=args.resume
        )
        _print_summary("run", summary)
        return 0
    if args.compare_sync:
        if args.resume:
            raise ValueError("--resume continues one run: leave out --compare-sync")
        result = compare.compare_sync(args.config, overrides, args.run_dir, args.free_ports, args.timeout_s)
        _print_summary("async", result["async"])
        _print_summary("sync (max_staleness=0)", result["sync"])
        print(f"async / sync speedup: {result['speedup_samples_per_s']:.2f}x samples/s")
        return 0
    if args.view is not None:
        viewer.start_for_run(args.run_dir or load_config(args.config, overrides).run_dir, args.view)
    summary = local.run(args.config, overrides, args.run_dir, args.free_ports, args.timeout_s, resume=args.resume)
    _print_summary("run", summary)
    if args.trace:
        _print_timeline(Path(summary["run_dir"]) / "trace.json")
    return 0


def _print_timeline(path: Path) -> None:
    """Where each process spent its time, from a merged trace, and where to open the trace."""
    from asyncrl.observe.trace import summary

    print(summary(json.loads(path.read_text())["traceEvents"]))
    print(f"timeline: {path} (open it at https://ui.perfetto.dev)")


def _quiet_failures(s: dict) -> str:
    """What went wrong without stopping the run, for its summary line: failed rewards, skipped dataset rows."""
    notes = []
    if failed := s.get("reward_failures"):
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(failed.items()))
        notes.append(f"rewards failed {sum(failed.values())} times ({reasons}; the generator logs say why)")
    if skipped := s.get("task_rows_skipped"):
        notes.append(f"dataset rows skipped: {skipped}")
    return "".join(f"{note}; " for note in notes)


def _print_summary(label: str, s: dict) -> None:
    print(
        f"{label}: {s['steps']} steps in {s['wall_s']:.1f}s training ({s['total_wall_s']:.1f}s with start-up); "
        + (
            f"reward {s['reward_start']:.3f} -> {s['reward_end']:.3f} (max {s['max_reward']:g}); "
            if s["reward_start"] is not None
            else "no reward scored; "
        )
        + _quiet_failures(s)
        + f"{s['achieved_samples_per_s']:.0f} samples/s; pipeline efficiency {s['pipeline_efficiency']:.2f} "
        f"(generators {s['generator_capacity_samples_per_s']:.0f}/s, "
        f"learner {s['learner_capacity_samples_per_s']:.0f}/s alone); "
        f"max staleness seen {s['staleness_max_observed']} (bound {s['max_staleness']}); "
        + (f"CUDA MPS clients seen {s['mps']['clients_seen']}; " if "mps" in s else "")
        + f"dropped {s['samples_dropped']}; outputs in {s['run_dir']}"
    )


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "run": _run,
    "sweep": _sweep,
    "eval": _eval,
    "status": status.command,
    "scale": _scale,
    "trace": _trace,
    "model": _model,
    "keys": _keys,
    "view": viewer.command,
    "plan": plan.command,
}


if __name__ == "__main__":
    sys.exit(main())
