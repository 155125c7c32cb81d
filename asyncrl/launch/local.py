"""``asyncrl run``: start a learner and its generators on this machine and watch them.

Each process is the real entrypoint (``asyncrl-learner``, ``asyncrl-generator``)
started as a subprocess with its own log under ``RUN_DIR/logs``, exactly as a
user would start them on separate machines. The launcher only supervises:
it draws the progress bar from ``metrics.jsonl``, stops every process it
started (by PID) when the learner ends or fails, and prints the summary.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.launch import mps
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
    try:
        with mps.daemon_for(config, out, _say(quiet)) as daemon:
            launch = _start(config_path, overrides, config, resume, daemon)
            started = time.monotonic()
            _supervise(config, launch, out, started, timeout_s, quiet, daemon)
        _check_finished(launch, out)
        return summarize(config, out, started, _mps_summary(daemon))
    finally:
        release(out)  # last: the folder is this run's until its summary is written


def _start(
    config_path: str, overrides: list[str], config: RunConfig, resume: bool, daemon: mps.Daemon | None
) -> Launch:
    """The run's learner, then its generators; what started is stopped again if a start fails."""
    launch = Launch(config_path, overrides, Path(config.run_dir), resume)
    try:
        args = ["--resume"] if resume else []
        launch.start("learner", "learners.cli", args, config.learner.devices, _env(daemon, "learner"))
        for i in range(config.generator.replicas):
            device = generator_devices(config, i)
            launch.start(
                f"generator-{i}", "generators.cli", generator_args(config, i), device, _env(daemon, "generator")
            )
    except BaseException:
        launch.stop_all(learner_grace_s=config.learner.stop_timeout_s)
        raise
    return launch


def generator_devices(config: RunConfig, i: int) -> str | None:
    """Generator ``i``'s GPUs (its CUDA_VISIBLE_DEVICES): ``generator.vllm.tensor_parallel_size`` of
    ``generator.devices`` in turn, one engine's worth each (None: the devices are left as they are)."""
    if not config.generator.devices:
        return None
    gpus = config.generator.devices.split(",")
    width = config.generator.vllm.tensor_parallel_size  # the config refuses fewer devices than this
    engines = max(1, len(gpus) // width)
    first = (i % engines) * width
    return ",".join(gpus[first : first + width])


def _env(daemon: mps.Daemon | None, side: str) -> dict[str, str | None] | None:
    return daemon.env(side) if daemon else None


def _mps_summary(daemon: mps.Daemon | None) -> dict[str, Any]:
    return {"mps": daemon.summary()} if daemon else {}


def _say(quiet: bool):
    return (lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))


def _check_finished(launch: Launch, out: Path, run: str | None = None) -> None:
    """Raise unless the learner of the run in ``out`` exited 0 having finished it; ``run`` names the run where
    several ran side by side."""
    code = launch.procs["learner"].returncode
    if code != 0:
        raise RuntimeError(
            f"the learner{f' of {run}' if run else ''} failed ({exit_description(code)}); last lines of its log:\n"
            + launch.tail("learner")
        )
    if why := stopped_early(out):
        raise RuntimeError(f"{run}: {why}" if run else why)


def _supervise(
    config: RunConfig,
    launch: Launch,
    out: Path,
    started: float,
    timeout_s: float,
    quiet: bool,
    daemon: mps.Daemon | None = None,
) -> None:
    """Show the run's progress until the learner exits; stop every process on the way out, however it ends."""
    try:
        learner = launch.procs["learner"]
        with Progress(config, out, started, timeout_s, quiet, pause=lambda s: _exited(learner, s)) as ticks:
            for _ in ticks:
                if daemon:
                    daemon.observe()
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


def _exited(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``proc`` to exit (a tick of the supervision loop that ends at its exit)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


def run_shared(
    config_paths: list[str], overrides: list[str], free_ports: bool, timeout_s: float, quiet: bool = False
) -> list[dict[str, Any]]:
    """Several LoRA runs on this machine that share one generator process and its engine
    (``asyncrl run A.yaml B.yaml``): a learner per run, in its own run folder, and one ``asyncrl-generator``
    given every run's config. Returns each run's summary, in the order of ``config_paths``."""
    from asyncrl.config import check_shared_engine

    prepared: list[tuple[RunConfig, list[str]]] = []
    try:
        for path in config_paths:
            prepared.append(prepare(path, overrides, None, free_ports))
        configs = [config for config, _ in prepared]
        check_shared_engine(configs, config_paths)
    except BaseException:
        for config, _ in prepared:
            release(Path(config.run_dir))
        raise
    outs = [Path(config.run_dir) for config in configs]
    try:
        with mps.daemon_for(configs[0], outs[0], _say(quiet)) as daemon:  # the first run's mps section
            launches, generator = _start_shared(config_paths, prepared, outs, daemon)
            started = time.monotonic()
            _supervise_shared(configs, launches, generator, started, timeout_s, quiet, daemon)
        summaries, failures = [], []
        for launch, out, config in zip(launches, outs, configs):
            try:
                _check_finished(launch, out, config.name)
            except RuntimeError as failure:  # the others are summarized all the same: they finished
                failures.append(str(failure))
                continue
            summaries.append(summarize(config, out, started, _mps_summary(daemon)))
        if failures:
            raise RuntimeError("\n".join(failures))
        return summaries
    finally:
        for out in outs:
            release(out)


def _start_shared(
    config_paths: list[str], prepared: list[tuple[RunConfig, list[str]]], outs: list[Path], daemon: mps.Daemon | None
) -> tuple[list[Launch], Launch]:
    """A learner per run, then the one generator given every run's config."""
    from asyncrl.config import to_yaml

    launches = [Launch(path, run_overrides, out) for path, (_, run_overrides), out in zip(config_paths, prepared, outs)]
    generator = Launch(str(outs[0] / "shared-generator.yaml"), [], outs[0])  # its log: the first run's
    try:
        for launch, (config, _) in zip(launches, prepared):
            launch.start("learner", "learners.cli", [], config.learner.devices, _env(daemon, "learner"))
        # The generator reads each run's config as its learner does: written out whole, overrides and ports applied.
        resolved = [out / "shared-generator.yaml" for out in outs]
        for path, (config, _) in zip(resolved, prepared):
            path.write_text(to_yaml(config))
        args = [*map(str, resolved[1:]), "--generator-id", "gen-0"]
        generator.start("generator-0", "generators.cli", args, env=_env(daemon, "generator"))
    except BaseException:  # what started is stopped again
        for launch in [*launches, generator]:
            launch.stop_all()
        raise
    return launches, generator


def _supervise_shared(
    configs: list[RunConfig],
    launches: list[Launch],
    generator: Launch,
    started: float,
    timeout_s: float,
    quiet: bool,
    daemon: mps.Daemon | None = None,
) -> None:
    """A progress bar per run until every learner exits; every process stopped on the way out."""
    bars = [
        Progress(config, Path(config.run_dir), started, timeout_s, quiet, position=i)
        for i, config in enumerate(configs)
    ]
    try:
        for _ in zip(*bars):
            if all(launch.procs["learner"].poll() is not None for launch in launches):
                break
            if daemon:
                daemon.observe()
            code = generator.procs["generator-0"].poll()
            if code not in (None, 0):
                raise RuntimeError(
                    f"the shared generator exited with an error ({exit_description(code)}); last lines of its log:\n"
                    + generator.tail("generator-0")
                )
    finally:
        for bar in bars:
            bar.__exit__()
        for launch, config in zip(launches, configs):
            launch.stop_all(learner_grace_s=config.learner.stop_timeout_s)
        generator.stop_all()
        for config in configs:
            merge_trace(config, Path(config.run_dir))
