"""What every actor of an ``asyncrl run --ray`` shares, and stopping many actors at once.

:class:`RunSpec` holds the actor class, the command line, the working
directory and the resources each kind of actor asks for; it also refuses a
run the cluster could never place, before anything starts, rather than wait
for it forever. :func:`stop_hosts` ends the learner ranks and the generators
together, so that one dead actor never cuts short the others' graceful stop.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.wire.ports import is_loopback

log = logging.getLogger("asyncrl.ray")

CALL_TIMEOUT_S = 30.0  # any single call to an actor, beyond the grace a stop() call is given


def _host_of(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def loopback_endpoint(config: RunConfig) -> str | None:
    """The first endpoint a generator must reach that only local peers can (``field address``), or None.

    Any one of them keeps every generator on this node: one placed elsewhere would connect to its own
    loopback and time out, restarting until Ray gives it up.
    """
    endpoints = {"coordinator.address": config.coordinator.address}
    if config.buffer.type == "zmq":
        endpoints["buffer.address"] = config.buffer.address
    elif config.buffer.type == "redis":
        endpoints["buffer.redis_url"] = config.buffer.redis_url
    if config.coordinator.weights_address:
        endpoints["coordinator.weights_address"] = config.coordinator.weights_address
    if config.push.address:
        endpoints["push.address"] = f"tcp://{config.push.address}"
    return next((f"{field} {address}" for field, address in endpoints.items() if is_loopback(address)), None)


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
        # Processes behind a loopback address must share this node.
        local = loopback_endpoint(config)
        self.local_generators = local is not None
        if local and not is_loopback(config.coordinator.address):
            log.warning("%s is a loopback address: every generator runs on this node", local)
        self.pin: dict[str, float] = {}
        node = ray.util.get_node_ip_address() if self.local_generators else _host_of(config.coordinator.address)
        if f"node:{node}" in resources:
            self.pin = {f"node:{node}": 0.001}
        elif self.local_generators:
            raise RuntimeError(
                f"{local} is a loopback address, but this "
                f"machine ({node}) is no node of the Ray cluster, so no process could reach it: run "
                "from the head node, or give the head node's IP (see docs/guides/ray.md)"
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
        self._check_pinned_node(generators)

    def _check_pinned_node(self, generators: int) -> None:
        """Where every generator is pinned to this node (a loopback endpoint), they and learner rank 0 must fit
        on it, not only in the cluster."""
        import ray

        if not (self.local_generators and self.pin):
            return
        [key] = self.pin
        node = next(
            (n.get("Resources", {}) for n in ray.nodes() if n.get("Alive") and key in n.get("Resources", {})), {}
        )
        for kind, learner, generator in (
            ("GPU", self.learner_gpus, self.generator_gpus),
            ("CPU", self.config.ray.learner_cpus, self.config.ray.generator_cpus),
        ):
            needed, have = learner + generators * generator, node.get(kind, 0.0)
            if needed > have + 1e-9:
                raise RuntimeError(
                    f"every generator runs on this node ({key.removeprefix('node:')}: a loopback address keeps them "
                    f"here), and with learner rank 0 they need {needed:g} {kind}s where it has {have:g}: give "
                    "every address the head node's IP (docs/guides/ray.md), or run fewer generators"
                )

    def log_path(self, name: str) -> str:
        """Where process ``name`` (``learner``, ``generator-0``) logs: ``RUN_DIR/logs/NAME.log``."""
        return str(self.out / "logs" / f"{name}.log")

    def tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of process ``name``'s log, for an error message."""
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
