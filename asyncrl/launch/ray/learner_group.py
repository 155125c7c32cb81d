"""The learner ranks of ``asyncrl run --ray``: one placement group, one actor per rank.

Placement: one placement group (strategy PACK) of ``learner.ranks`` bundles
of ``ray.learner_cpus`` CPUs and ``ray.learner_gpus`` GPUs, one actor per
bundle, each running one rank with ``RANK``/``WORLD_SIZE`` and a
``MASTER_ADDR:MASTER_PORT`` found on rank 0's node (``env://``
rendezvous). One actor per rank rather than torchrun inside one actor: PACK
may spread the bundles over nodes when one node lacks room, which torchrun
on one host cannot follow, and the same code runs with gloo on CPU
(``DS_ACCELERATOR=cpu``) as with NCCL on GPUs. Bundle 0 (the rank that binds
the buffer and the control endpoint) is pinned to the node that owns
``coordinator.address``: this one for a loopback address, else the node with
that IP. A group not placed within ``ray.start_timeout_s`` is reported rather
than waited for.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from asyncrl.launch.ray.spec import CALL_TIMEOUT_S, RunSpec, stop_hosts
from asyncrl.run_folder import exit_description, stopped_early

log = logging.getLogger("asyncrl.ray")


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
        """Give the placement group's resources back to the cluster."""
        import ray

        ray.util.remove_placement_group(self.pg)
