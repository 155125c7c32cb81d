"""``asyncrl run``: start a learner and its generators on this machine and watch them.

Each process is the real entrypoint (``asyncrl-learner``, ``asyncrl-generator``)
started as a subprocess with its own log under ``RUN_DIR/logs``, exactly as a
user would start them on separate machines. The launcher only supervises:
it draws the progress bar from ``metrics.jsonl``, stops every process it
started (by PID) when the learner ends or fails, and prints the summary.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.launch.preflight import prepare
from asyncrl.launch.processes import Launch
from asyncrl.launch.progress import Progress, merge_trace, summarize
from asyncrl.run_folder import exit_description, release, stopped_early


def generator_args(config: RunConfig, i: int) -> list[str]:
    """Command-line arguments of generator ``i`` of a run: its id, push rank and metrics port."""
    return ["--generator-id", f"gen-{i}", *config.replica_overrides(i)]


def run(
    config_path: str,
    overrides: list[str],
    run_dir: str | None,
    free_ports: bool,
    timeout_s: float,
    quiet: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run one training job to completion (``resume``: from the run folder's newest checkpoint); returns its
    summary (raises on failure)."""
    config, overrides = prepare(config_path, overrides, run_dir, free_ports, resume=resume)
    out = Path(config.run_dir)
    launch = Launch(config_path, overrides, out, resume)
    launch.start("learner", "learners.cli", ["--resume"] if resume else [], config.learner.devices)
    gpus = config.generator.devices.split(",") if config.generator.devices else None
    for i in range(config.generator.replicas):
        launch.start(
            f"generator-{i}", "generators.cli", generator_args(config, i), gpus[i % len(gpus)] if gpus else None
        )
    started = time.monotonic()
    try:
        _supervise(config, launch, out, started, timeout_s, quiet)
        if launch.procs["learner"].returncode != 0:
            raise RuntimeError(
                f"the learner failed ({exit_description(launch.procs['learner'].returncode)}); "
                "last lines of its log:\n" + launch.tail("learner")
            )
        if why := stopped_early(out):
            raise RuntimeError(why)
        return summarize(config, out, started)
    finally:
        release(out)  # last: the folder is this run's until its summary is written


def _supervise(config: RunConfig, launch: Launch, out: Path, started: float, timeout_s: float, quiet: bool) -> None:
    """Show the run's progress until the learner exits; stop every process on the way out, however it ends."""
    try:
        with Progress(config, out, started, timeout_s, quiet) as ticks:
            for _ in ticks:
                if launch.procs["learner"].poll() is not None:
                    break
                dead = [n for n, p in launch.procs.items() if n != "learner" and p.poll() not in (None, 0)]
                if dead and len(dead) == config.generator.replicas:
                    raise RuntimeError(
                        f"every generator exited with an error ({dead[0]} "
                        f"{exit_description(launch.procs[dead[0]].returncode)}); last lines of "
                        f"{dead[0]}:\n" + launch.tail(dead[0])
                    )
    finally:
        launch.stop_all(learner_grace_s=config.learner.stop_timeout_s)
        merge_trace(config, out)
