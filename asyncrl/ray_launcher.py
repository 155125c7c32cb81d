"""``asyncrl run --ray``: the run's processes placed and supervised by Ray.

Ray schedules and supervises; it is not the data plane. Every learner rank
and generator is the real entrypoint, hosted by one
:class:`~asyncrl.ray_actors.EntrypointHost` actor each; rollouts go through
the ZeroMQ or Redis buffer, weights through the configured transport, and
the coordinator lives in learner rank 0, exactly as without Ray. Logs and
outputs land in the same ``RUN_DIR`` (``logs/learner.log``,
``logs/generator-I.log``), plus ``logs/ray.log`` for this driver's events.

Placement:

* **Learner**: one placement group (strategy PACK) of ``learner.ranks``
  bundles of ``ray.learner_cpus`` CPUs and ``ray.learner_gpus`` GPUs, one
  actor per bundle, each running one rank with ``RANK``/``WORLD_SIZE`` and a
  ``MASTER_ADDR:MASTER_PORT`` found on rank 0's node (``env://``
  rendezvous). One actor per rank rather than torchrun inside one actor:
  PACK may spread the bundles over nodes when one node lacks room, which
  torchrun on one host cannot follow, and the same code runs with gloo on
  CPU (``DS_ACCELERATOR=cpu``) as with NCCL on GPUs. Bundle 0 (the rank that
  binds the buffer and the control endpoint) is pinned to the node that owns
  ``coordinator.address``: this one for a loopback address, else the node
  with that IP.
* **Generators**: one actor each (``ray.generator_cpus``,
  ``ray.generator_gpus``), restarted by Ray up to ``ray.max_restarts`` times
  when it dies. With a loopback ``coordinator.address`` they stay on this node.

Fault tolerance:

* A generator that dies (its process or its actor) is restarted by Ray
  under the same generator id. The new process loads the latest published
  version before it takes work, and the learner, seeing a new incarnation
  at its first request, issues the old process's tickets again at once
  (``slots_released: generator_restarted``); a group the old process had
  half written arrives as an orphan and is dropped, so nothing is trained twice.
* A learner rank that fails is reported (with the tail of its log) and,
  while ``learner.restarts`` allows, every rank is started again with
  ``--resume`` from the last checkpoint (from step 0 where there is none);
  the generators keep running and rejoin it.

Elastic pool: ``asyncrl scale RUN_DIR --generators N`` writes
``RUN_DIR/ray/scale.json``; this driver polls it, starts or removes
generator actors, and reports in ``RUN_DIR/ray/pool.json`` (both JSON via
msgspec). A new generator loads the latest published version before it
takes tickets (a weight push group has a fixed size, so a run with
``push.address`` cannot be scaled). A removed one gets SIGTERM: it finishes
and writes the groups it holds, then exits; only one that outlives
``ray.drain_timeout_s`` is killed, and its tickets are reissued when its
lease runs out.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import msgspec

from asyncrl.config import RunConfig
from asyncrl.transport import is_loopback

log = logging.getLogger("asyncrl.ray")

POLL_S = 0.5
CALL_TIMEOUT_S = 30.0  # any single call to an actor
STOP_GRACE_S = 10.0  # processes still running when the run ends


class ScaleRequest(msgspec.Struct):
    """``RUN_DIR/ray/scale.json``: the generator count ``asyncrl scale`` asks for."""

    generators: int
    request_id: str


class GeneratorState(msgspec.Struct):
    """One generator actor as the driver last saw it."""

    state: Literal["starting", "running", "restarting", "draining", "done", "dead"]
    node: str | None = None
    pid: int | None = None  # the generator process
    actor_pid: int | None = None  # the Ray worker hosting it
    deaths: int = 0  # times its actor died (Ray restarts it while max_restarts allows)


class PoolState(msgspec.Struct):
    """``RUN_DIR/ray/pool.json``: the generator pool of a running ``asyncrl run --ray``."""

    ray_address: str
    driver_pid: int
    target: int
    generators: dict[str, GeneratorState]
    learner_pids: list[int] = []  # the learner's rank processes, rank 0 first
    learner_starts: int = 0  # 1, plus one per restart after a failure
    applied_request: str | None = None
    error: str | None = None  # why the last scale request was refused
    updated_s: float = 0.0


def _pool_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ray"


def read_pool(run_dir: str | Path) -> PoolState | None:
    """The pool file of a run, or None before the driver wrote one."""
    path = _pool_dir(Path(run_dir)) / "pool.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=PoolState)
    except (FileNotFoundError, msgspec.DecodeError):  # absent, or caught mid-replace on a network FS
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def scale(run_dir: str | Path, generators: int, timeout_s: float) -> PoolState:
    """Ask the run's driver for ``generators`` generators; wait until they run (or raise)."""
    if generators < 0:
        raise ValueError("--generators must be >= 0")
    pool = read_pool(run_dir)
    if pool is None:
        raise RuntimeError(f"{run_dir} has no ray/pool.json: is `asyncrl run --ray` running there?")
    request = ScaleRequest(generators=generators, request_id=uuid.uuid4().hex[:12])
    _write_atomic(_pool_dir(Path(run_dir)) / "scale.json", msgspec.json.encode(request))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = read_pool(run_dir)
        if pool is not None and pool.applied_request == request.request_id:
            if pool.error:
                raise RuntimeError(pool.error)
            if sum(g.state == "running" for g in pool.generators.values()) == generators \
                    and all(g.state in ("running", "done", "dead") for g in pool.generators.values()):
                return pool
        time.sleep(POLL_S)
    raise TimeoutError(f"the pool did not reach {generators} running generators within {timeout_s:.0f}s; "
                       f"see {Path(run_dir) / 'ray' / 'pool.json'} and {Path(run_dir) / 'logs' / 'ray.log'}")


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
            raise RuntimeError(f"could not join the Ray cluster at {address}: {exc}\n(a cluster started with "
                               "`ray start` may require token authentication: RAY_AUTH_MODE=token, with the "
                               "head node's ~/.ray/auth_token on this machine)") from None
        return False
    cores = len(os.sched_getaffinity(0))
    cpus = config.ray.local_cpus or max(cores, int(needed_cpus + 0.999))
    # address="local": a new instance of our own, never one a `ray start` left running here
    ray.init(address="local", num_cpus=cpus, namespace="asyncrl", log_to_driver=False, runtime_env=runtime_env,
             object_store_memory=256 * 2**20)  # nothing of the run goes through Ray's object store
    return True


def _host_of(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


class _Actors:
    """What every actor of the run shares: the actor class, command line, working directory."""

    def __init__(self, config: RunConfig, config_path: str, overrides: list[str], tag: str) -> None:
        import ray

        from asyncrl.ray_actors import EntrypointHost

        self.config = config
        self.out = Path(config.run_dir).resolve()
        self.tag = tag
        self.cls = ray.remote(EntrypointHost)
        self.base = [str(Path(config_path).resolve()), *overrides]
        self.cwd = os.getcwd()
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.generator_gpus = config.ray.generator_gpus if config.ray.generator_gpus is not None \
            else (config.generator.vllm.tensor_parallel_size if has_gpus else 0)
        self.learner_gpus = config.ray.learner_gpus if config.ray.learner_gpus is not None else (1 if has_gpus else 0)
        # Processes behind a loopback control address must share this node.
        self.pin: dict[str, float] = {}
        host = _host_of(config.coordinator.address)
        node = ray.util.get_node_ip_address() if is_loopback(config.coordinator.address) else host
        if f"node:{node}" in ray.cluster_resources():
            self.pin = {f"node:{node}": 0.001}
        elif not is_loopback(config.coordinator.address):
            log.warning("coordinator.address %s is no node's IP: learner rank 0 may land anywhere", host)
        self.local_generators = is_loopback(config.coordinator.address)

    def log_path(self, name: str) -> str:
        return str(self.out / "logs" / f"{name}.log")


class _LearnerGroup:
    """The learner ranks: one placement group, one actor per rank, restarted together from a checkpoint."""

    def __init__(self, actors: _Actors) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.actors = actors
        config = actors.config
        bundle = {k: v for k, v in (("CPU", config.ray.learner_cpus), ("GPU", actors.learner_gpus)) if v}
        bundles = [dict(bundle) for _ in range(config.learner.ranks)]
        bundles[0].update(actors.pin)
        self.pg = placement_group(bundles, strategy="PACK", name=f"{actors.tag}-learner")
        try:
            ray.get(self.pg.ready(), timeout=config.ray.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise TimeoutError(f"the cluster could not place {config.learner.ranks} learner bundles of {bundles[0]} "
                               f"within {config.ray.start_timeout_s:.0f}s (ray.start_timeout_s); available: "
                               f"{ray.available_resources()}") from None
        self.hosts: list[Any] = []
        self.pids: list[int] = []
        self.starts = 0

    def start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a, config = self.actors, self.actors.config
        resume = self.starts > 0 and (a.out / "checkpoints" / "LATEST").exists()
        if self.starts > 0 and not resume:
            log.warning("no checkpoint yet: the learner starts again from step 0")
            for name in ("metrics.jsonl", "consumed.jsonl", "dropped.jsonl"):
                (a.out / name).unlink(missing_ok=True)
        self.starts += 1
        ranks = config.learner.ranks
        names = ["learner" if r == 0 else f"learner-{r}" for r in range(ranks)]
        self.hosts = [
            a.cls.options(name=f"{a.tag}-{names[r]}-{self.starts}", num_cpus=config.ray.learner_cpus,
                          num_gpus=a.learner_gpus, max_restarts=0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self.pg, placement_group_bundle_index=r)).remote(names[r], a.log_path(names[r]))
            for r in range(ranks)
        ]
        master_addr, master_port = ray.get(self.hosts[0].rendezvous.remote(), timeout=config.ray.start_timeout_s)
        command = ["-m", "learners.cli", *a.base, *(["--resume"] if resume else [])]
        self.pids = ray.get([host.start.remote(command, a.cwd, {
            "RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}) for r, host in enumerate(self.hosts)],
            timeout=config.ray.start_timeout_s)
        log.info("learner: %d rank(s) started%s", ranks, " with --resume" if resume else "")

    def poll(self) -> tuple[Literal["running", "done", "failed"], str]:
        """The group's state and, when it failed, why."""
        import ray

        refs = [host.poll.remote() for host in self.hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        codes: list[int | None] = []
        for r, ref in enumerate(refs):
            if ref not in ready:
                codes.append(None)
                continue
            try:
                codes.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                return "failed", f"the actor of learner rank {r} died: {exc}"
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return "failed", f"learner rank {failed[0][0]} exited with {failed[0][1]}"
        if codes[0] == 0:
            if not (self.actors.out / "summary.json").exists():
                return "failed", "the learner stopped before its last step (SIGTERM?)"
            return "done", ""
        return "running", ""

    def stop(self) -> None:
        import ray

        try:
            ray.get([host.stop.remote(STOP_GRACE_S) for host in self.hosts], timeout=STOP_GRACE_S + CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("stopping the learner: %s", exc)
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        self.hosts = []

    def close(self) -> None:
        import ray

        self.stop()
        ray.util.remove_placement_group(self.pg)


class _GeneratorPool:
    """Generator actors by index; Ray restarts a dead one, :meth:`scale` adds and removes them."""

    def __init__(self, actors: _Actors, ray_address: str) -> None:
        self.actors = actors
        self.hosts: dict[int, Any] = {}
        self.draining: dict[int, tuple[Any, Any]] = {}  # index -> (actor, the ref of its stop() call)
        self.pool = PoolState(ray_address=ray_address, driver_pid=os.getpid(), target=0, generators={})
        self.pending: dict[int, Any] = {}  # index -> the ref of its latest poll

    def _add(self, i: int) -> None:
        from asyncrl.launcher import generator_args

        a, config = self.actors, self.actors.config
        name = f"generator-{i}"
        options: dict[str, Any] = dict(
            name=f"{a.tag}-{name}", num_cpus=config.ray.generator_cpus, num_gpus=a.generator_gpus,
            max_restarts=config.ray.max_restarts, max_task_retries=0)
        if a.local_generators and a.pin:
            options["resources"] = dict(a.pin)
        self.hosts[i] = a.cls.options(**options).remote(
            name, a.log_path(name), ["-m", "generators.cli", *a.base, *generator_args(config, i)], a.cwd, None, True)
        self.pool.generators[f"gen-{i}"] = GeneratorState(state="starting")
        log.info("%s: actor created", name)

    def scale(self, n: int) -> None:
        """Start generators up to ``n`` and drain those above it (the highest indices first)."""
        self.pool.target = n
        running = sorted(self.hosts)
        for i in running[n:]:
            log.info("generator-%d: draining (removed)", i)
            host = self.hosts.pop(i)
            self.pending.pop(i, None)
            self.draining[i] = (host, host.stop.remote(self.actors.config.ray.drain_timeout_s))
            self.pool.generators[f"gen-{i}"].state = "draining"
        i = 0
        while len(self.hosts) < n:
            if i not in self.hosts and i not in self.draining:  # a draining index comes back once it is gone
                self._add(i)
            i += 1

    def poll(self) -> None:
        """Refresh every generator's state from its actor; log deaths and restarts."""
        import ray

        max_restarts = self.actors.config.ray.max_restarts
        for i, host in self.hosts.items():
            if i not in self.pending:
                self.pending[i] = host.info.remote()
        ready, _ = ray.wait(list(self.pending.values()), num_returns=len(self.pending), timeout=0.2)
        for i, ref in list(self.pending.items()):
            if ref not in ready:
                continue
            del self.pending[i]
            if i not in self.hosts:
                continue
            g = self.pool.generators[f"gen-{i}"]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError:
                g.deaths += 1
                out_of_restarts = 0 <= max_restarts < g.deaths
                g.state = "dead" if out_of_restarts else "restarting"
                log.warning("generator-%d: its actor died (%d time(s)); %s", i, g.deaths,
                            "no restarts left (ray.max_restarts)" if out_of_restarts else "Ray restarts it")
                if out_of_restarts:
                    del self.hosts[i]
                continue
            if g.state != "running" and info["returncode"] is None:
                log.info("generator-%d: running as pid %s on %s%s", i, info["pid"], info["node"],
                         " (restarted)" if info["restarted"] else "")
            g.node, g.pid, g.actor_pid = info["node"], info["pid"], info["actor_pid"]
            g.state = "running" if info["returncode"] is None else "done"
        for i, (host, ref) in list(self.draining.items()):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    code: Any = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    code = f"its actor failed: {exc}"
                log.info("generator-%d: removed (exit %s)", i, code)
                ray.kill(host, no_restart=True)
                del self.draining[i]
                self.pool.generators.pop(f"gen-{i}", None)

    def all_dead(self) -> bool:
        return bool(self.pool.generators) and all(g.state == "dead" for g in self.pool.generators.values())

    def write(self, applied: str | None = None, error: str | None = None) -> None:
        if applied is not None:
            self.pool.applied_request, self.pool.error = applied, error
        self.pool.updated_s = time.time()
        _write_atomic(_pool_dir(self.actors.out) / "pool.json", msgspec.json.encode(self.pool))

    def close(self) -> None:
        import ray

        hosts = [*self.hosts.values(), *(host for host, _ in self.draining.values())]
        refs = [host.stop.remote(STOP_GRACE_S) for host in self.hosts.values()]
        try:
            ray.get(refs, timeout=STOP_GRACE_S + CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("stopping generators: %s", exc)
        for host in hosts:
            ray.kill(host, no_restart=True)


def _read_request(out: Path) -> ScaleRequest | None:
    try:
        return msgspec.json.decode((_pool_dir(out) / "scale.json").read_bytes(), type=ScaleRequest)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def _thread_overrides(config: RunConfig) -> list[str]:
    """Each process's torch threads: the CPUs its actor holds, where the config leaves them unset."""
    cpus = {"learner": config.ray.learner_cpus, "generator": config.ray.generator_cpus}
    return [f"--{section}.torch_threads={max(1, int(cpus[section]))}" for section in cpus
            if getattr(config, section).torch_threads is None]


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


def run(config_path: str, overrides: list[str], run_dir: str | None, free_ports: bool, timeout_s: float,
        address: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run one training job on Ray to completion; returns its summary (raises on failure)."""
    from asyncrl.extras import require

    require("ray", "asyncrl run --ray")
    import ray
    from tqdm import tqdm

    from asyncrl import launcher
    from asyncrl.metrics import read_metrics

    config, overrides = launcher.prepare(config_path, overrides, run_dir, free_ports, threads=False)
    overrides += _thread_overrides(config)
    if config.learner.devices or config.generator.devices:
        log.warning("learner.devices and generator.devices are ignored with --ray: Ray assigns GPUs")
    out = Path(config.run_dir).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in [*(out / "logs").glob("learner*.log"), *(out / "logs").glob("generator-*.log"), out / "logs/ray.log"]:
        old.unlink(missing_ok=True)  # a fresh run in an old folder starts fresh logs; restarts append
    handler = _log_to(out / "logs" / "ray.log")
    _pool_dir(out).mkdir(parents=True, exist_ok=True)
    for name in ("scale.json", "pool.json"):
        (_pool_dir(out) / name).unlink(missing_ok=True)
    needed = (config.ray.learner_cpus * config.learner.ranks
              + config.ray.generator_cpus * config.generator.replicas)
    started_here = _connect(address, config, needed)
    learner = pool = None
    started = time.monotonic()
    bar = None
    try:
        actors = _Actors(config, config_path, [f"--run_dir={out}", *overrides], f"{config.name}-{uuid.uuid4().hex[:6]}")
        gcs = ray.get_runtime_context().gcs_address
        log.info("on Ray at %s (%s): %s", gcs, "started here" if started_here else "joined",
                 {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})
        learner = _LearnerGroup(actors)
        learner.start()
        pool = _GeneratorPool(actors, gcs)
        pool.scale(config.generator.replicas)
        pool.write()
        restarts_left = config.learner.restarts
        applied: str | None = None
        bar = tqdm(total=config.learner.total_steps, desc=config.name, dynamic_ncols=True, disable=quiet or None)
        while True:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"run did not finish within {timeout_s:.0f}s (--timeout-s)")
            launcher.update_bar(bar, read_metrics(out))
            state, why = learner.poll()
            if state == "done":
                break
            if state == "failed":
                tail = "\n".join(Path(actors.log_path("learner")).read_text(errors="replace").splitlines()[-15:])
                if restarts_left <= 0:
                    raise RuntimeError(f"the learner failed: {why}; last lines of its log:\n{tail}")
                restarts_left -= 1
                log.error("the learner failed: %s; restarting it from its last checkpoint (%d restart(s) left)",
                          why, restarts_left)
                learner.stop()
                learner.start()
                continue
            pool.poll()
            if pool.all_dead():
                raise RuntimeError(f"every generator died more than ray.max_restarts ({config.ray.max_restarts}) "
                                   f"times; see {out / 'logs'}")
            pool.pool.learner_pids, pool.pool.learner_starts = learner.pids, learner.starts
            request = _read_request(out)
            if request is not None and request.request_id != applied:
                applied = request.request_id
                if config.push.address and request.generators != pool.pool.target:
                    pool.write(applied, "a run with push.address has a fixed weight push group "
                                        f"(push.generators={config.push.generators}): it cannot be scaled")
                else:
                    log.info("scale: %d -> %d generators", pool.pool.target, request.generators)
                    pool.scale(request.generators)
                    pool.write(applied)
            pool.write()
            time.sleep(POLL_S)
        launcher.update_bar(bar, read_metrics(out))
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.close()
            pool.write()
        if learner is not None:
            learner.close()
        ray.shutdown()  # stops an instance started here; from a cluster, only disconnects
        log.removeHandler(handler)
        handler.close()
        if config.trace:
            from asyncrl.trace import merge

            merge(out)
    return launcher.summarize(config, out, started)
