"""The generators of ``asyncrl run --ray``: one actor each, restarted by Ray, scaled by ``asyncrl scale``.

Each generator actor asks for ``ray.generator_cpus`` and
``ray.generator_gpus`` and is restarted by Ray up to ``ray.max_restarts``
times when it dies. With a loopback ``coordinator.address`` they stay on
this node (which must then be a node of the cluster). A generator not placed
within ``ray.start_timeout_s`` is reported, rather than waited for forever.
How ``asyncrl scale`` asks for more or fewer: :mod:`asyncrl.launch.ray.scaling`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.launch.ray.scaling import GeneratorState, PoolState, ScaleRequest, pool_dir, write_atomic
from asyncrl.launch.ray.spec import RunSpec
from asyncrl.run_folder import exit_description

log = logging.getLogger("asyncrl.ray")

END_GRACE_S = 5.0  # after the learner finished, for a generator it told to stop to exit by itself


class GeneratorPool:
    """Generator actors by index; Ray restarts a dead one, :meth:`scale` adds and removes them."""

    def __init__(self, spec: RunSpec, ray_address: str, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (seconds, monotonic) times how long an actor has waited to be placed."""
        self.spec = spec
        self.clock = clock
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
        self.created[i] = self.clock()
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
            if ref in ready:
                del self.pending[i]
                self._take_info(i, ref)
            else:
                self._check_placed(i)
        self._reap_drained()

    def _check_placed(self, i: int) -> None:
        """Drop a generator whose actor Ray has not placed within ``ray.start_timeout_s``."""
        import ray

        g = self.state.generators[f"gen-{i}"]
        waited = self.clock() - self.created[i]
        if g.state == "starting" and waited > self.spec.config.ray.start_timeout_s:
            ray.kill(self.hosts[i], no_restart=True)
            self._drop(
                i,
                f"not placed within ray.start_timeout_s ({waited:.0f}s): it asks for "
                f"{self.spec.config.ray.generator_cpus:g} CPU(s) and {self.spec.generator_gpus:g} "
                f"GPU(s); the cluster has {ray.available_resources()} available",
            )
            self.state.error = g.reason

    def _take_info(self, i: int, ref: Any) -> None:
        """A generator's state from what its info() call answered; a new actor pid is a restart by Ray."""
        import ray

        g = self.state.generators[f"gen-{i}"]
        try:
            info = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # Ray is restarting it
            g.state = "restarting"
            return
        except ray.exceptions.RayActorError as exc:  # for good: out of restarts, or its constructor failed
            self._drop(
                i,
                f"its actor is dead ({str(exc).splitlines()[0]}; "
                f"ray.max_restarts: {self.spec.config.ray.max_restarts})",
            )
            return
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

    def _reap_drained(self) -> None:
        """Remove the generators whose drain (their stop() call) has ended, from Ray and from the pool file."""
        import ray

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
        """Write the pool file; ``applied``: the scale request now done, with ``error`` where it was refused."""
        if applied is not None:
            self.state.applied_request, self.state.error = applied, error
        self.state.updated_s = time.time()
        write_atomic(pool_dir(self.spec.out) / "pool.json", msgspec.json.encode(self.state))

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
