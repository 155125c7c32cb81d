"""asyncrl sweep: every cell of a grid of config overrides, for N seeds, one run at a time (or side by side); then a
report.

Runs `asyncrl run CONFIG` as a subprocess for every cell of the grids'
cartesian product and every seed k in 0..N-1 (--learner.seed=k
--generator.seed=k: the prompt order and the sampling vary, the prompts and
held-out sets do not), each with the config's own budget
(learner.total_steps and/or learner.max_train_s), into
DIR/runs/<cell>/seed<k>. OVERRIDES (after --) go to every run.

Runs go one after another by default: runs sharing a machine would compete
for its cores and GPUs and distort the throughput and time to target being
compared. With --side-by-side N, a sweep of LoRA runs (learner.lora) runs N
at a time as `asyncrl run A.yaml B.yaml ...`: a learner each and one
generator whose vLLM engine serves them all, each run with its own adapter
slot, coordinator and buffer. The runs of a group share the machine, so
compare their times with each other's, not with runs made alone; cells that
change the engine (model.path, generator.vllm.*) cannot share one and are
refused. Every grid value is checked against CONFIG before anything runs.
A failed run is reported (DIR/runs/<cell>/seed<k>/error.txt) and the sweep
goes on.

Invoking the same command again resumes: runs that exited 0 are kept,
unfinished and failed ones rerun; DIR/sweep.json holds the sweep's
definition, and a different sweep is refused in the same DIR. The report is
rebuilt from the run dirs alone (build_report): DIR/sweep.csv (one row per
run), DIR/report.md (mean +- std per cell, async/sync speedup in time to
target) and its PNGs.

example:
  asyncrl sweep configs/ci-tiny.yaml --grid staleness.max_staleness=0,1,2,4 \\
      --grid algo.off_policy=none,tis,decoupled --seeds 3 --out sweeps/staleness \\
      --target-reward 0.5 -- --learner.max_train_s=600
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from asyncrl.config import ConfigError, apply_overrides, finite_number, load_config, positive_seconds, to_yaml
from asyncrl.envs import check_environment
from asyncrl.launch.processes import stop_with_launcher
from asyncrl.launch.sweep.grid import (
    RESERVED_KEYS,
    SEED_KEYS,
    Cell,
    Grid,
    finished,
    flatten,
    make_cells,
    parse_grid,
    run_path,
)
from asyncrl.launch.sweep.report import build_report
from asyncrl.run_folder import claim
from asyncrl.tasks import check_task

ERROR_TAIL_LINES = 40


KILL_GRACE_S = 120.0  # start-up: past --timeout-s, this and its stop time, a run is interrupted (see run_one)


# The launcher's stop past learner.stop_timeout_s: the generators' grace, the learner's stack dump, merging traces.
STOP_MARGIN_S = 60.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``asyncrl sweep`` on the ``asyncrl`` command's subparsers (cheap: nothing heavy is imported)."""
    sweep = sub.add_parser(
        "sweep",
        help="run every cell of a grid of overrides for N seeds (one run at a time, or side by side), and report",
        usage="asyncrl sweep CONFIG --grid KEY=V1,V2,... [--grid ...] [--seeds N] --out DIR [--target-reward R]\n"
        "                     [--side-by-side N] [--timeout-s S] [-- OVERRIDES ...]",
        description=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("config")
    sweep.add_argument(
        "--grid",
        action="append",
        metavar="KEY=V1,V2,...",
        help="a dotted config key and its values, comma-separated; repeat for more keys",
    )
    sweep.add_argument("--seeds", type=int, default=1, metavar="N", help="runs per cell, seeds 0..N-1 (default 1)")
    sweep.add_argument(
        "--out", required=True, metavar="DIR", help="the sweep's folder: sweep.json, runs/, sweep.csv, report.md"
    )
    sweep.add_argument(
        "--target-reward",
        type=finite_number,
        default=None,
        metavar="R",
        help="time to target: first wall-clock second the reward's 10-step running mean reaches R",
    )
    sweep.add_argument(
        "--side-by-side",
        type=int,
        default=1,
        metavar="N",
        help="LoRA runs: N at a time on one shared generator engine (default 1: one run at a time)",
    )
    sweep.add_argument(
        "--timeout-s",
        type=positive_seconds,
        default=3600.0,
        metavar="S",
        help="give up on one run after S seconds (default 3600)",
    )


def seed_overrides(seed: int) -> list[str]:
    """The command-line overrides that give one run its seed: every key of ``SEED_KEYS`` set to ``seed``."""
    return [f"--{key}={seed}" for key in SEED_KEYS]


def validate(config: str, grids: Sequence[Grid], extra: Sequence[str]) -> list[Cell]:
    """Every grid value alone, then every cell whole, through ``load_config``: errors come before any run."""
    if not Path(config).is_file():
        raise ConfigError(f"config file not found: {config}")
    try:
        extra_keys = set(flatten(apply_overrides({}, list(extra))))
    except (ConfigError, yaml.YAMLError) as exc:
        raise ConfigError(f"the overrides for every run: {exc}") from None
    taken = extra_keys & ({key for key, _ in grids} | set(RESERVED_KEYS))
    if taken:
        raise ConfigError(
            f"the overrides for every run set {', '.join(sorted(taken))}, which the sweep itself sets "
            "(--grid, --seeds, --out)"
        )
    _load(config, list(extra), "the overrides for every run" if extra else config, task=True)
    for key, values in grids:
        for value in values:
            _load(
                config,
                [f"--{key}={value}", *extra],
                f"--grid {key}={','.join(values)}: value {value!r}",
                task=key.startswith("task."),
            )
    cells = make_cells(grids)
    for cell in cells:
        _load(config, [*cell.overrides, *seed_overrides(0), *extra], f"the cell {cell.label}")
    return cells


def _load(config: str, overrides: list[str], what: str, task: bool = False) -> None:
    """Load the config as a run would; with ``task``, check its task too (reward, prompts, dataset)."""
    try:
        loaded = load_config(config, overrides)
        if task:
            check_task(loaded.task)
            check_environment(loaded.task)
    except (ValueError, FileNotFoundError, yaml.YAMLError) as exc:  # ConfigError is a ValueError
        raise ConfigError(f"{what}: {exc}") from None


def definition(config: str, grids: Sequence[Grid], seeds: int, extra: Sequence[str]) -> dict[str, Any]:
    """What makes two invocations the same sweep (stored in ``OUT/sweep.json``)."""
    return {
        "config": str(Path(config).resolve()),
        "config_sha256": hashlib.sha256(Path(config).read_bytes()).hexdigest(),
        "grids": [[key, list(values)] for key, values in grids],
        "seeds": seeds,
        "extra_overrides": list(extra),
    }


def open_out(out: Path, wanted: dict[str, Any], target_reward: float | None) -> None:
    """Create ``out/sweep.json``, or check that the one there describes the same sweep."""
    path = out / "sweep.json"
    stored = json.loads(path.read_text()) if path.exists() else dict(wanted, target_reward=None)
    differ = [key for key in wanted if stored.get(key) != wanted[key]]
    if differ:
        raise RuntimeError(
            f"{path} describes another sweep ({', '.join(differ)} differ): use another --out, "
            f"or delete {out} to start over"
        )
    if target_reward is not None:  # unset: keep the stored one, so a resume without it still reports it
        stored["target_reward"] = target_reward
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=2) + "\n")


def pending_runs(out: Path, cells: Sequence[Cell], seeds: int) -> list[tuple[Cell, int]]:
    """The runs still to do. A run dir of an unfinished run (interrupted or failed) is removed, to start clean."""
    todo = []
    for cell, seed in itertools.product(cells, range(seeds)):
        path = run_path(out, cell, seed)
        if finished(path):
            continue
        if path.exists():
            shutil.rmtree(path)
        todo.append((cell, seed))
    return todo


def run_one(config: str, cell: Cell, seed: int, extra: Sequence[str], path: Path, timeout_s: float) -> str | None:
    """``asyncrl run`` for one (cell, seed); None on success, else why it failed (also in ``path/error.txt``).
    Interrupted, it leaves no error, and perhaps the learner's part of ``summary.json``: not :func:`finished`."""
    overrides = [*cell.overrides, *seed_overrides(seed), *extra]
    # Once stopped (--timeout-s, Ctrl-C), the launcher waits up to learner.stop_timeout_s for the learner to
    # checkpoint: killed sooner, it would leave the learner holding the GPU while the next run starts.
    try:
        stop_s = load_config(config, overrides).learner.stop_timeout_s + STOP_MARGIN_S
    except (ValueError, FileNotFoundError, yaml.YAMLError):  # the config changed since validate: asyncrl run
        stop_s = STOP_MARGIN_S  # refuses it at once, before any learner starts, and error.txt says why
    limit_s = timeout_s + KILL_GRACE_S + stop_s
    path.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "run",
        config,
        "--run-dir",
        str(path),
        "--free-ports",
        "--timeout-s",
        str(timeout_s),
        *overrides,
    ]
    rc, reason, tail = _launch(cmd, path / "sweep-run.log", limit_s, stop_s)
    if rc == 0 and finished(path):
        return None
    (path / "error.txt").write_text(f"{reason}\n" + "\n".join(tail) + "\n")
    return f"{reason}: {next((line for line in reversed(tail) if line.strip()), '')}"


def _launch(cmd: list[str], log_path: Path, limit_s: float, stop_s: float) -> tuple[int | None, str, list[str]]:
    """Run ``cmd`` (an ``asyncrl run``) logging to ``log_path`` for up to ``limit_s``, then stop it (:func:`_stop`);
    its exit code (None: still running at the limit), why it failed if it did, and the log's last lines."""
    with open(log_path, "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        # Its own session, so a Ctrl-C reaches it once, from _stop, and not also from the terminal: a second
        # SIGINT would cut short the launcher stopping the processes it started.
        # It gets SIGTERM should the sweep die unhandled (SIGKILL, the out-of-memory killer): never trains on.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=stop_with_launcher()
        )
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop(proc, stop_s)
    tail = log_path.read_text(errors="replace").splitlines()[-ERROR_TAIL_LINES:]
    return rc, f"exit code {rc}" if rc is not None else f"still running after {limit_s:.0f}s", tail


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT, which ``asyncrl run`` answers by stopping the processes it started; SIGKILL after ``grace_s``
    (the run's ``learner.stop_timeout_s`` and a margin: see ``run_one``)."""
    if proc.poll() is not None:
        return
    print(f"asyncrl sweep: stopping the run (up to {grace_s:.0f}s: its learner checkpoints)", file=sys.stderr)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sweep(
    config: str,
    grids: Sequence[Grid],
    seeds: int,
    out: str | Path,
    extra: Sequence[str] = (),
    target_reward: float | None = None,
    timeout_s: float = 3600.0,
    side_by_side: int = 1,
) -> tuple[Path, int]:
    """Run every (cell, seed) not finished yet, ``side_by_side`` at a time (more than one: on one shared
    generator engine); returns the report's path and the failed count."""
    from tqdm import tqdm

    if seeds < 1:
        raise ConfigError("--seeds must be >= 1")
    if side_by_side < 1:
        raise ConfigError("--side-by-side must be >= 1")
    cells = validate(config, grids, extra)
    if side_by_side > 1:
        check_side_by_side(config, cells, seeds, extra)
    out = Path(out)
    claim(out, "sweep", "wait for it to end, or give this one another --out")  # it would delete the other's runs
    open_out(out, definition(config, grids, seeds, extra), target_reward)
    todo = pending_runs(out, cells, seeds)
    total, failed = len(cells) * seeds, 0
    with tqdm(total=total, initial=total - len(todo), desc="sweep", unit="run", dynamic_ncols=True) as bar:
        for start in range(0, len(todo), side_by_side):
            group = todo[start : start + side_by_side]
            bar.set_postfix_str("; ".join(f"{cell.label}, seed {seed}" for cell, seed in group))
            if side_by_side == 1:
                [(cell, seed)] = group
                errors = [run_one(config, cell, seed, extra, run_path(out, cell, seed), timeout_s)]
            else:
                errors = run_group(config, group, extra, out, timeout_s)
            for (cell, seed), error in zip(group, errors):
                if error:
                    failed += 1
                    where = run_path(out, cell, seed) / "error.txt"
                    bar.write(f"failed: {cell.label}, seed {seed}: {error} (see {where})")
            bar.update(len(group))
    return build_report(out), failed


def check_side_by_side(config: str, cells: Sequence[Cell], seeds: int, extra: Sequence[str]) -> None:
    """Before any run: every run of the sweep can share one generator engine with the others."""
    from asyncrl.config import check_one_engine

    runs = [(cell, seed) for cell in cells for seed in range(seeds)]
    loaded = [load_config(config, [*cell.overrides, *seed_overrides(seed), *extra]) for cell, seed in runs]
    try:
        check_one_engine(loaded, [f"the cell {cell.label}, seed {seed}" for cell, seed in runs])
    except ConfigError as exc:
        raise ConfigError(f"--side-by-side: {exc}") from None


def run_group(config: str, group: Sequence[tuple[Cell, int]], extra: Sequence[str], out: Path, timeout_s: float):
    """``asyncrl run`` of several (cell, seed) at once on one shared generator engine: each run's config written
    whole to ``OUT/configs``; per run, None on success, else why it failed (also in its ``error.txt``)."""
    configs_dir = out / "configs"
    configs_dir.mkdir(exist_ok=True)
    paths = []
    for cell, seed in group:
        path = run_path(out, cell, seed)
        path.mkdir(parents=True)
        name = f"{cell.slug}-seed{seed}"
        overrides = [*cell.overrides, *seed_overrides(seed), *extra, f"--run_dir={path}", f"--name={name}"]
        paths.append(configs_dir / f"{name}.yaml")
        paths[-1].write_text(to_yaml(load_config(config, overrides)))
    stop_s = max(load_config(str(p)).learner.stop_timeout_s for p in paths) + STOP_MARGIN_S
    limit_s = timeout_s + KILL_GRACE_S + stop_s
    cmd = [sys.executable, "-m", "asyncrl.launch.cli", "run", *map(str, paths), "--free-ports"]
    cmd += ["--timeout-s", str(timeout_s)]
    log_path = out / "configs" / f"{paths[0].stem}.log"  # the group's log: one launcher for every run of it
    rc, reason, tail = _launch(cmd, log_path, limit_s, stop_s)
    errors = []
    for cell, seed in group:
        path = run_path(out, cell, seed)
        if finished(path):  # completed by the launcher, whatever became of the runs beside it
            errors.append(None)
            continue
        (path / "error.txt").write_text(f"{reason} (the runs side by side: {log_path})\n" + "\n".join(tail) + "\n")
        errors.append(f"{reason}: {next((line for line in reversed(tail) if line.strip()), '')}")
    return errors


def command(args: argparse.Namespace, overrides: list[str]) -> int:
    """``asyncrl sweep``: parse the grids, run what is left, print where the report is."""
    grids = [parse_grid(spec) for spec in args.grid or []]
    extra = [o for o in overrides if o != "--"]
    report, failed = sweep(
        args.config, grids, args.seeds, args.out, extra, args.target_reward, args.timeout_s, args.side_by_side
    )
    print(f"report: {report} (table per cell: {report.parent / 'sweep.csv'})")
    if failed:
        print(f"asyncrl sweep: {failed} run(s) failed; invoke the same command again to rerun them", file=sys.stderr)
        return 1
    return 0
