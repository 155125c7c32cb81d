"""The actors of ``asyncrl run --ray`` and the pool file ``asyncrl scale`` talks through.

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
  when it dies. With a loopback ``coordinator.address`` they stay on this node
  (which must then be a node of the cluster).
* A run that needs more GPUs or CPUs than the cluster has is refused before
  anything starts, and a generator not placed within ``ray.start_timeout_s``
  is reported, rather than either waiting forever.

Elastic pool: ``asyncrl scale RUN_DIR --generators N`` writes
``RUN_DIR/ray/scale.json``; the driver polls it, starts or removes
generator actors, and reports in ``RUN_DIR/ray/pool.json`` (both JSON via
msgspec). A new generator loads the latest published version before it
takes tickets (a weight push group has a fixed size, so a run with
``push.address`` cannot be scaled). A removed one gets SIGTERM: it finishes
and writes the groups it holds, tells the learner it leaves, then exits;
only one that outlives ``ray.drain_timeout_s`` is killed, and its tickets
are reissued when its lease runs out.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import msgspec

from asyncrl.config import RunConfig
from asyncrl.run_folder import exit_description, stopped_early
from asyncrl.wire.ports import is_loopback

log = logging.getLogger("asyncrl.ray")

POLL_S = 0.5  # the driver's loop, and asyncrl scale waiting for the pool to follow
CALL_TIMEOUT_S = 30.0  # any single call to an actor, beyond the grace a stop() call is given
END_GRACE_S = 5.0  # after the learner finished, for a generator it told to stop to exit by itself


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
    restarts: int = 0  # times Ray restarted its actor (seen as a new actor pid)
    reason: str | None = None  # why it is dead, or how it ended when the run stopped


class PoolState(msgspec.Struct):
    """``RUN_DIR/ray/pool.json``: the generator pool of a running ``asyncrl run --ray``."""

    ray_address: str
    driver_pid: int
    target: int
    generators: dict[str, GeneratorState]
    learner_pids: list[int] = []  # the learner's rank processes, rank 0 first
    learner_starts: int = 0  # 1, plus one per restart after a failure
    applied_request: str | None = None
    error: str | None = None  # why the last scale request was refused, or a generator could not be placed
    updated_s: float = 0.0


def pool_dir(run_dir: Path) -> Path:
    """Where the driver and ``asyncrl scale`` talk: ``RUN_DIR/ray`` (``scale.json`` in, ``pool.json`` out)."""
    return Path(run_dir) / "ray"


def read_pool(run_dir: str | Path) -> PoolState | None:
    """The pool file of a run, or None before the driver wrote one."""
    path = pool_dir(Path(run_dir)) / "pool.json"
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
    _write_atomic(pool_dir(Path(run_dir)) / "scale.json", msgspec.json.encode(request))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = read_pool(run_dir)
        if pool is not None and pool.applied_request == request.request_id:
            if pool.error:
                raise RuntimeError(pool.error)
            if sum(g.state == "running" for g in pool.generators.values()) == generators and all(
                g.state in ("running", "done", "dead") for g in pool.generators.values()
            ):
                return pool
        time.sleep(POLL_S)
    raise TimeoutError(
        f"the pool did not reach {generators} running generators within {timeout_s:.0f}s; "
        f"see {Path(run_dir) / 'ray' / 'pool.json'} and {Path(run_dir) / 'logs' / 'ray.log'}"
    )


def _host_of(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


class RunSpec:
    """What every actor of the run shares: the actor class, command line, working directory, resources."""

    def __init__(
        self, config: RunConfig, config_path: str, overrides: list[str], tag: str, resume: bool = False
    ) -> None:
        import ray

        from asyncrl.launch.ray.actors import EntrypointHost

        self.config = config
        self.resume = resume  # asyncrl run --resume: the learner's first start continues the folder's checkpoint
        self.out = Path(config.run_dir).resolve()
        self.tag = tag
        self.cls = ray.remote(EntrypointHost)
        self.base = [str(Path(config_path).resolve()), *overrides]
        self.cwd = os.getcwd()
        resources = ray.cluster_resources()
        has_gpus = resources.get("GPU", 0) > 0
        self.generator_gpus = (
            config.ray.generator_gpus
            if config.ray.generator_gpus is not None
            else (config.generator.vllm.tensor_parallel_size if has_gpus else 0)
        )
        self.learner_gpus = config.ray.learner_gpus if config.ray.learner_gpus is not None else (1 if has_gpus else 0)
        # Processes behind a loopback control address must share this node.
        self.local_generators = is_loopback(config.coordinator.address)
        self.pin: dict[str, float] = {}
        node = ray.util.get_node_ip_address() if self.local_generators else _host_of(config.coordinator.address)
        if f"node:{node}" in resources:
            self.pin = {f"node:{node}": 0.001}
        elif self.local_generators:
            raise RuntimeError(
                f"coordinator.address {config.coordinator.address} is a loopback address, but this "
                f"machine ({node}) is no node of the Ray cluster, so no process could reach it: run "
                "from the head node, or give the head node's IP (see the README, Ray)"
            )
        else:
            log.warning("coordinator.address %s is no node's IP: learner rank 0 may land anywhere", node)

    def check_resources(self, generators: int, local: bool) -> None:
        """Refuse a run whose actors the cluster could never place (rather than wait for them forever)."""
        import ray

        config, total = self.config, ray.cluster_resources()
        ranks = config.learner.ranks
        for kind, learner, generator, keys in (
            ("GPU", self.learner_gpus, self.generator_gpus, "ray.learner_gpus / ray.generator_gpus"),
            ("CPU", config.ray.learner_cpus, config.ray.generator_cpus, "ray.learner_cpus / ray.generator_cpus"),
        ):
            needed, have = ranks * learner + generators * generator, total.get(kind, 0.0)
            if needed <= have + 1e-9:
                continue
            if kind == "GPU" and not have:
                hint = "it has no GPU: leave ray.learner_gpus and ray.generator_gpus unset, and the run uses none"
            elif kind == "GPU":
                hint = "actors may share a GPU with fractions, e.g. --ray.learner_gpus=0.5 --ray.generator_gpus=0.5"
            else:
                hint = "a local instance takes ray.local_cpus" if local else ""
            raise RuntimeError(
                f"the run needs {needed:g} {kind}s ({ranks} learner rank(s) x {learner:g} + "
                f"{generators} generator(s) x {generator:g}, from {keys}) but the Ray cluster "
                f"has {have:g}{': ' + hint if hint else ''}"
            )

    def log_path(self, name: str) -> str:
        return str(self.out / "logs" / f"{name}.log")

    def tail(self, name: str, lines: int = 15) -> str:
        path = Path(self.log_path(name))
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def stop_hosts(calls: dict[str, tuple[Any, float, bool]]) -> dict[str, int | None | str]:
    """Call ``stop(grace_s, terminate)`` on every host at once and wait for each; kill them all after.

    One dead actor must not cut short the others' graceful stop, so each
    answer is taken on its own: an exit code (None: never started), or why
    there is none.
    """
    import ray

    if not calls:
        return {}
    refs = {key: host.stop.remote(grace_s, terminate) for key, (host, grace_s, terminate) in calls.items()}
    longest = max(grace_s for _, grace_s, _ in calls.values())
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=longest + CALL_TIMEOUT_S)
    results: dict[str, int | None | str] = {}
    for key, ref in refs.items():
        if ref not in ready:
            results[key] = "its actor did not answer"
            continue
        try:
            results[key] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            results[key] = f"its actor failed: {str(exc).splitlines()[0]}"
    for host, _, _ in calls.values():
        ray.kill(host, no_restart=True)
    return results


class LearnerGroup:
    """The learner ranks: one placement group, one actor per rank, restarted together from a checkpoint."""

    def __init__(self, spec: RunSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.spec = spec
        config = spec.config
        bundle = {k: v for k, v in (("CPU", config.ray.learner_cpus), ("GPU", spec.learner_gpus)) if v}
        bundles = [dict(bundle) for _ in range(config.learner.ranks)]
        bundles[0].update(spec.pin)
        self.pg = placement_group(bundles, strategy="PACK", name=f"{spec.tag}-learner")
        try:
            ray.get(self.pg.ready(), timeout=config.ray.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise TimeoutError(
                f"the cluster could not place {config.learner.ranks} learner bundles of {bundles[0]} "
                f"within {config.ray.start_timeout_s:.0f}s (ray.start_timeout_s); available: "
                f"{ray.available_resources()}"
            ) from None
        self.hosts: list[Any] = []
        self.names = ["learner" if r == 0 else f"learner-{r}" for r in range(config.learner.ranks)]
        self.pids: list[int] = []
        self.starts = 0

    def has_checkpoint(self) -> bool:
        """Whether the run folder holds a checkpoint: this run's (a fresh run's folder has none, which
        ``launcher.prepare`` checked), or with ``--resume`` the one it continues."""
        return (self.spec.out / "checkpoints" / "LATEST").is_file()

    def start(self) -> bool:
        """Start every rank (again: with ``--resume`` from this run's checkpoint where there is one);
        True if resumed."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec, config = self.spec, self.spec.config
        resume = self.has_checkpoint() and (self.starts > 0 or spec.resume)
        if self.starts > 0 and not resume:
            log.warning("no checkpoint of this run yet: the learner starts again from step 0")
            for name in ("metrics.jsonl", "consumed.jsonl", "dropped.jsonl"):
                (spec.out / name).unlink(missing_ok=True)
        self.starts += 1
        ranks = config.learner.ranks
        self.hosts = [
            spec.cls.options(
                name=f"{spec.tag}-{self.names[r]}-{self.starts}",
                num_cpus=config.ray.learner_cpus,
                num_gpus=spec.learner_gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote(self.names[r], spec.log_path(self.names[r]))
            for r in range(ranks)
        ]
        master_addr, master_port = ray.get(self.hosts[0].rendezvous.remote(), timeout=config.ray.start_timeout_s)
        command = ["-m", "learners.cli", *spec.base, *(["--resume"] if resume else [])]
        self.pids = ray.get(
            [
                host.start.remote(
                    command,
                    spec.cwd,
                    {
                        "RANK": str(r),
                        "LOCAL_RANK": "0",
                        "WORLD_SIZE": str(ranks),
                        "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": master_addr,
                        "MASTER_PORT": str(master_port),
                    },
                )
                for r, host in enumerate(self.hosts)
            ],
            timeout=config.ray.start_timeout_s,
        )
        log.info("learner: %d rank(s) started%s", ranks, " with --resume" if resume else "")
        return resume

    def poll(self) -> tuple[Literal["running", "done", "failed"], str, int]:
        """The group's state and, when it failed, why and which rank."""
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
                return "failed", f"the actor of learner rank {r} died: {str(exc).splitlines()[0]}", r
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return "failed", f"learner rank {failed[0][0]} {exit_description(failed[0][1])}", failed[0][0]
        if codes[0] == 0:
            if why := stopped_early(self.spec.out):
                return "failed", why, 0
            return "done", "", 0
        return "running", "", 0

    def stop_calls(self, graceful: bool) -> dict[str, tuple[Any, float, bool]]:
        """The stop() calls of every rank: SIGTERM (it checkpoints) when ``graceful``, else SIGKILL."""
        calls = {
            name: (host, self.spec.config.learner.stop_timeout_s if graceful else 0.0, True)
            for name, host in zip(self.names, self.hosts)
        }
        self.hosts = []
        return calls

    def stop(self, graceful: bool) -> None:
        """End every rank (see :meth:`stop_calls`)."""
        for name, result in stop_hosts(self.stop_calls(graceful)).items():
            if isinstance(result, str):
                log.warning("stopping %s: %s", name, result)

    def close(self) -> None:
        import ray

        ray.util.remove_placement_group(self.pg)


class GeneratorPool:
    """Generator actors by index; Ray restarts a dead one, :meth:`scale` adds and removes them."""

    def __init__(self, spec: RunSpec, ray_address: str) -> None:
        self.spec = spec
        self.hosts: dict[int, Any] = {}
        self.created: dict[int, float] = {}  # index -> when its actor was asked for (monotonic)
        self.draining: dict[int, tuple[Any, Any]] = {}  # index -> (actor, the ref of its stop() call)
        self.state = PoolState(ray_address=ray_address, driver_pid=os.getpid(), target=0, generators={})
        self.pending: dict[int, Any] = {}  # index -> the ref of its latest info() call
        self.generation = 0  # counts start-overs of the whole pool, to keep actor names unique
        self.drained_at_close = True

    def _add(self, i: int) -> None:
        from asyncrl.launch.local import generator_args

        spec, config = self.spec, self.spec.config
        name = f"generator-{i}"
        options: dict[str, Any] = dict(
            name=f"{spec.tag}-{name}" + (f"-{self.generation}" if self.generation else ""),
            num_cpus=config.ray.generator_cpus,
            num_gpus=spec.generator_gpus,
            max_restarts=config.ray.max_restarts,
            max_task_retries=0,
        )
        if spec.local_generators and spec.pin:
            options["resources"] = dict(spec.pin)
        self.hosts[i] = spec.cls.options(**options).remote(
            name,
            spec.log_path(name),
            ["-m", "generators.cli", *spec.base, *generator_args(config, i)],
            spec.cwd,
            None,
            True,
        )
        self.created[i] = time.monotonic()
        self.state.generators[f"gen-{i}"] = GeneratorState(state="starting")
        log.info("%s: actor created", name)

    def scale(self, n: int) -> None:
        """Start generators up to ``n`` and drain those above it (the highest indices first)."""
        self.state.target = n
        for i in sorted(self.hosts)[n:]:
            log.info("generator-%d: draining (removed)", i)
            host = self.hosts.pop(i)
            self.pending.pop(i, None)
            self.draining[i] = (host, host.stop.remote(self.spec.config.ray.drain_timeout_s, True))
            self.state.generators[f"gen-{i}"].state = "draining"
        i = 0
        while len(self.hosts) < n:
            if i not in self.hosts and i not in self.draining:  # a draining index comes back once it is gone
                self._add(i)
            i += 1

    def start_over(self) -> None:
        """Replace every generator with a fresh one, on the base weights (version 0).

        For a learner that starts over from step 0: generators already on a
        later version would wait for it forever, as nothing ever goes back.
        """
        import ray

        log.warning("the generators start over too, on version 0")
        for _, host in [*self.hosts.items(), *((i, host) for i, (host, _) in self.draining.items())]:
            ray.kill(host, no_restart=True)
        self.hosts, self.draining, self.pending = {}, {}, {}
        self.state.generators = {}
        self.generation += 1
        self.scale(self.state.target)

    def _drop(self, i: int, reason: str) -> None:
        g = self.state.generators[f"gen-{i}"]
        g.state, g.reason = "dead", reason
        log.error("generator-%d: %s", i, reason)
        self.hosts.pop(i, None)
        self.pending.pop(i, None)

    def poll(self) -> None:
        """Refresh every generator's state from its actor; log restarts, deaths and actors never placed."""
        import ray

        for i, host in self.hosts.items():
            if i not in self.pending:
                self.pending[i] = host.info.remote()
        ready, _ = ray.wait(list(self.pending.values()), num_returns=len(self.pending), timeout=0.2)
        for i, ref in list(self.pending.items()):
            g = self.state.generators[f"gen-{i}"]
            if ref not in ready:
                waited = time.monotonic() - self.created[i]
                if g.state == "starting" and waited > self.spec.config.ray.start_timeout_s:
                    ray.kill(self.hosts[i], no_restart=True)
                    self._drop(
                        i,
                        f"not placed within ray.start_timeout_s ({waited:.0f}s): it asks for "
                        f"{self.spec.config.ray.generator_cpus:g} CPU(s) and {self.spec.generator_gpus:g} "
                        f"GPU(s); the cluster has {ray.available_resources()} available",
                    )
                    self.state.error = g.reason
                continue
            del self.pending[i]
            try:
                info = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # Ray is restarting it
                g.state = "restarting"
                continue
            except ray.exceptions.RayActorError as exc:  # for good: out of restarts, or its constructor failed
                self._drop(
                    i,
                    f"its actor is dead ({str(exc).splitlines()[0]}; "
                    f"ray.max_restarts: {self.spec.config.ray.max_restarts})",
                )
                continue
            restarted = g.actor_pid is not None and info["actor_pid"] != g.actor_pid
            if restarted:
                g.restarts += 1
            if restarted or (g.state != "running" and info["returncode"] is None):
                log.info(
                    "generator-%d: running as pid %s on %s%s",
                    i,
                    info["pid"],
                    info["node"],
                    f" (its actor restarted by Ray: {g.restarts} time(s))" if restarted else "",
                )
            g.node, g.pid, g.actor_pid = info["node"], info["pid"], info["actor_pid"]
            g.state = "running" if info["returncode"] is None else "done"
        for i, (host, ref) in list(self.draining.items()):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    code: Any = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    code = f"its actor failed: {str(exc).splitlines()[0]}"
                log.info("generator-%d: removed (exit %s)", i, code)
                ray.kill(host, no_restart=True)
                del self.draining[i]
                self.state.generators.pop(f"gen-{i}", None)

    def all_dead(self) -> str | None:
        """Why no generator is left, if none is."""
        generators = self.state.generators.values()
        if generators and all(g.state == "dead" for g in generators):
            return "; ".join(sorted({g.reason or "dead" for g in generators}))
        return None

    def write(self, applied: str | None = None, error: str | None = None) -> None:
        if applied is not None:
            self.state.applied_request, self.state.error = applied, error
        self.state.updated_s = time.time()
        _write_atomic(pool_dir(self.spec.out) / "pool.json", msgspec.json.encode(self.state))

    def stop_calls(self, drain: bool) -> dict[str, tuple[Any, float, bool]]:
        """The stop() calls of every generator.

        Drained (SIGTERM) while a learner runs to take what they write; once
        it has finished, a generator it told to stop is only waited for a
        moment, and one still waiting for it is killed.
        """
        grace_s = self.spec.config.ray.drain_timeout_s if drain else END_GRACE_S
        calls = {f"gen-{i}": (host, grace_s, drain) for i, host in self.hosts.items()}
        calls.update({f"gen-{i}": (host, grace_s, drain) for i, (host, _) in self.draining.items()})
        self.hosts, self.draining, self.pending = {}, {}, {}
        self.drained_at_close = drain
        return calls

    def record(self, results: dict[str, int | None | str]) -> None:
        """The pool's final states, from what each stop() call answered."""
        for key, result in results.items():
            g = self.state.generators.get(key)
            if g is None or g.state == "dead":
                continue
            if result in (0, None):
                g.state = "done"
            elif result == -signal.SIGKILL and not self.drained_at_close:
                g.state, g.reason = "done", f"killed: still running {END_GRACE_S:g}s after the learner finished"
            else:
                g.state = "dead"
                g.reason = result if isinstance(result, str) else exit_description(result)


def read_request(out: Path) -> ScaleRequest | None:
    """The latest ``asyncrl scale`` request of the run in ``out``, or None (none yet, or caught mid-replace)."""
    try:
        return msgspec.json.decode((pool_dir(out) / "scale.json").read_bytes(), type=ScaleRequest)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def apply_request(request: ScaleRequest, spec: RunSpec, pool: GeneratorPool, local: bool) -> None:
    """Scale the pool as ``asyncrl scale`` asked, or record why not (where ``asyncrl scale`` reads it)."""
    config = spec.config
    if config.push.address and request.generators != pool.state.target:
        pool.write(
            request.request_id,
            "a run with push.address has a fixed weight push group "
            f"(push.generators={config.push.generators}): it cannot be scaled",
        )
        return
    try:
        spec.check_resources(request.generators, local)
    except RuntimeError as exc:
        pool.write(request.request_id, str(exc))
        return
    log.info("scale: %d -> %d generators", pool.state.target, request.generators)
    pool.scale(request.generators)
    pool.write(request.request_id)
