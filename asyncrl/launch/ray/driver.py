"""``asyncrl run --ray``: the run's processes placed and supervised by Ray.

Ray schedules and supervises; it is not the data plane. Every learner rank
and generator is the real entrypoint, hosted by one
:class:`~asyncrl.launch.ray.actors.EntrypointHost` actor each; rollouts go through
the ZeroMQ or Redis buffer, weights through the configured transport, and
the coordinator lives in learner rank 0, exactly as without Ray. Logs and
outputs land in the same ``RUN_DIR`` (``logs/learner.log``,
``logs/generator-I.log``), plus ``logs/ray.log`` for this driver's events.

Fault tolerance:

* A generator that dies (its process or its actor) is restarted by Ray
  under the same generator id. The new process loads the latest published
  version before it takes work, and the learner, seeing a new incarnation
  at its first request, issues the old process's tickets again at once
  (``slots_released: generator_restarted``); a group the old process had
  half written arrives as an orphan and is dropped, so nothing is trained twice.
  The driver counts restarts by the actor's pid changing (a call in flight
  at the death may or may not see it); an actor Ray will not bring back
  (its restarts used up, or its constructor failed) is reported dead.
* A learner rank that fails is reported (with the tail of its log) and,
  while ``learner.restarts`` allows, every rank is started again with
  ``--resume`` from the last checkpoint this run wrote; the generators keep
  running and rejoin it. Before its first checkpoint the learner starts over
  from step 0 at version 0, and so do the generators: one already on a later
  version would wait for it forever.
* SIGTERM to this driver stops the run as an error does: the learner gets
  SIGTERM (it checkpoints) and generators drain, within ``learner.stop_timeout_s``.

Placement: :mod:`asyncrl.launch.ray.learner_group` and :mod:`asyncrl.launch.ray.pool`; the elastic pool:
:mod:`asyncrl.launch.ray.scaling`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from asyncrl import run_folder
from asyncrl.config import ConfigError, RunConfig
from asyncrl.launch import preflight, processes, progress
from asyncrl.launch.ray.learner_group import LearnerGroup
from asyncrl.launch.ray.pool import GeneratorPool, apply_request
from asyncrl.launch.ray.scaling import POLL_S, pool_dir, read_request
from asyncrl.launch.ray.spec import RunSpec, stop_hosts

log = logging.getLogger("asyncrl.ray")


def _connect(address: str | None, config: RunConfig, needed_cpus: float) -> bool:
    """Join the cluster at ``address`` (or RAY_ADDRESS), or start a local instance; True if started here."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    # Forward what the child processes need to import the user's code (a reward module on PYTHONPATH).
    runtime_env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else None
    if address:
        try:
            ray.init(address=address, namespace="asyncrl", log_to_driver=False, runtime_env=runtime_env)
        except (ConnectionError, ray.exceptions.RayError) as exc:
            raise RuntimeError(
                f"could not join the Ray cluster at {address}: {exc}\n(a cluster started with "
                "token authentication needs RAY_AUTH_MODE=token here, and the head node's "
                "~/.ray/auth_token on this machine)"
            ) from None
        return False
    cores = len(os.sched_getaffinity(0))
    # Logical CPUs, oversubscribed: Ray's CPUs only place actors here, and each process's torch
    # threads follow its own ray.*_cpus, so room for `asyncrl scale` costs nothing until it is used.
    cpus = config.ray.local_cpus or max(4 * cores, math.ceil(needed_cpus))
    # address="local": a new instance of our own, never one a `ray start` left running here
    ray.init(
        address="local",
        num_cpus=cpus,
        namespace="asyncrl",
        log_to_driver=False,
        runtime_env=runtime_env,
        object_store_memory=256 * 2**20,
    )  # nothing of the run goes through Ray's object store
    return True


def _thread_overrides(config: RunConfig) -> list[str]:
    """Each process's torch threads: the CPUs its actor holds, where the config leaves them unset."""
    cpus = {"learner": config.ray.learner_cpus, "generator": config.ray.generator_cpus}
    return [
        f"--{section}.torch_threads={max(1, int(cpus[section]))}"
        for section in cpus
        if getattr(config, section).torch_threads is None
    ]


def _log_to(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    if not any(isinstance(h, logging.StreamHandler) and h.stream is sys.stderr for h in log.handlers):
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("asyncrl ray: %(message)s"))
        log.addHandler(stream)
    log.setLevel(logging.INFO)
    log.propagate = False
    return handler


def _without_shared_weights(config: RunConfig) -> list[str]:
    """Ray places the processes, perhaps on other GPUs or machines: weights travel as folders or pushes."""
    if config.learner.shared_weights:
        raise ConfigError(
            "learner.shared_weights: not with --ray, which may place the learner and the "
            "generators on different GPUs or machines; use folders or push.address"
        )
    config.learner.shared_weights = False
    return ["--learner.shared_weights=false"]


def run(
    config_path: str,
    overrides: list[str],
    run_dir: str | None,
    free_ports: bool,
    timeout_s: float,
    address: str | None = None,
    quiet: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run one training job on Ray to completion (``resume``: from the run folder's newest checkpoint);
    returns its summary (raises on failure)."""
    from asyncrl.extras import require

    require("ray", "asyncrl run --ray")
    config, overrides = preflight.prepare(config_path, overrides, run_dir, free_ports, local=False, resume=resume)
    out = Path(config.run_dir).resolve()
    try:
        started = _supervise(config, config_path, overrides, out, address, timeout_s, quiet, resume)
        return progress.summarize(config, out, started)
    finally:
        run_folder.release(out)  # last: the folder is this run's until its summary is written


def _supervise(
    config: RunConfig,
    config_path: str,
    overrides: list[str],
    out: Path,
    address: str | None,
    timeout_s: float,
    quiet: bool,
    resume: bool,
) -> float:
    """Start the run's actors on Ray and watch them (restarts, scaling) until the learner is done; stop
    every one on the way out, however it ends. Returns when the run started (``time.monotonic()``)."""
    import ray

    overrides = [*overrides, *_thread_overrides(config)]
    if config.learner.devices or config.generator.devices:
        log.warning("learner.devices and generator.devices are ignored with --ray: Ray assigns GPUs")
    overrides += _without_shared_weights(config)
    handler = _prepare_folder(out, resume)
    needed = config.ray.learner_cpus * config.learner.ranks + config.ray.generator_cpus * config.generator.replicas
    # SIGTERM stops the run as after any error, the learner checkpointing; a second one ends the driver at once
    # (Ray then removes its actors, and their processes die with them).
    previous_handler = processes.interrupt_on_sigterm()
    learner = pool = None
    learner_state = "running"
    started = time.monotonic()
    try:
        started_here = _connect(address, config, needed)
        processes.interrupt_on_sigterm()  # again: ray.init installed its own, which ends the driver uncleaned
        spec = RunSpec(
            config, config_path, [f"--run_dir={out}", *overrides], f"{config.name}-{uuid.uuid4().hex[:6]}", resume
        )
        gcs = ray.get_runtime_context().gcs_address
        log.info(
            "on Ray at %s (%s): %s",
            gcs,
            "started here" if started_here else "joined",
            {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")},
        )
        spec.check_resources(config.generator.replicas, started_here)
        learner = LearnerGroup(spec)
        learner.start()
        pool = GeneratorPool(spec, gcs)
        pool.scale(config.generator.replicas)
        pool.write()
        restarts_left = config.learner.restarts
        applied: str | None = None
        with progress.Progress(config, out, started, timeout_s, quiet, every_s=POLL_S) as ticks:
            for _ in ticks:
                learner_state, why, rank = learner.poll()
                if learner_state == "done":
                    break
                if learner_state == "failed":
                    restarts_left = _restart(learner, pool, why, rank, restarts_left)
                    learner_state = "running"
                    continue
                pool.poll()
                gone = pool.all_dead()
                if gone:
                    raise RuntimeError(f"every generator is dead: {gone}; see {out / 'logs'}")
                pool.state.learner_pids, pool.state.learner_starts = learner.pids, learner.starts
                request = read_request(out)
                if request is not None and request.request_id != applied:
                    applied = request.request_id
                    apply_request(request, spec, pool, started_here)
                pool.write()
    finally:
        if ray.is_initialized():
            _stop_everything(learner, pool, learner_running=learner_state == "running")
            ray.shutdown()  # stops an instance started here; from a cluster, only disconnects
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        log.removeHandler(handler)
        handler.close()
        progress.merge_trace(config, out)
    return started


def _prepare_folder(out: Path, resume: bool) -> logging.Handler:
    """Clear what an earlier run left in ``out`` (its logs, unless resumed; its pool files) and start ray.log."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not resume:  # a fresh run in an old folder starts fresh logs; restarts and resumes append
        for old in [
            *(out / "logs").glob("learner*.log"),
            *(out / "logs").glob("generator-*.log"),
            out / "logs/ray.log",
        ]:
            old.unlink(missing_ok=True)
    handler = _log_to(out / "logs" / "ray.log")
    pool_dir(out).mkdir(parents=True, exist_ok=True)
    for name in ("scale.json", "pool.json"):
        (pool_dir(out) / name).unlink(missing_ok=True)
    return handler


def _restart(learner: LearnerGroup, pool: GeneratorPool, why: str, rank: int, restarts_left: int) -> int:
    """Start a failed learner again from its last checkpoint (the generators too, where it has none yet);
    returns the restarts left, or raises with the tail of the failed rank's log when none is."""
    spec = learner.spec
    name = learner.names[rank]
    if restarts_left <= 0:
        raise RuntimeError(f"the learner failed: {why}; last lines of {spec.log_path(name)}:\n" + spec.tail(name))
    restarts_left -= 1
    log.error("the learner failed: %s; restarting it from its last checkpoint (%d restart(s) left)", why, restarts_left)
    learner.stop(graceful=False)  # the ranks left cannot checkpoint without the failed one
    if not learner.start():
        pool.start_over()
    return restarts_left


def _stop_everything(learner: LearnerGroup | None, pool: GeneratorPool | None, learner_running: bool) -> None:
    """Stop every actor at once: generators drain while a running learner checkpoints; record how each ended."""
    calls = pool.stop_calls(drain=learner_running) if pool is not None else {}
    if learner is not None:  # the ranks of a failed learner cannot checkpoint without the failed one
        calls.update(learner.stop_calls(graceful=learner_running))
    results = stop_hosts(calls)
    for name, result in results.items():
        if isinstance(result, str):
            log.warning("stopping %s: %s", name, result)
    if pool is not None:
        pool.record(results)
        pool.write()
    if learner is not None:
        learner.close()
