"""Ways to split a cluster between generators and learner, each played by the simulation, best first.

A split gives ``learner_gpus`` to the learner (its rate grows in proportion,
which ZeRO-3 data parallelism approaches at a fixed batch per GPU) and the
rest to generator engines of ``gpus_per_generator`` GPUs each. Every split is
tried with each staleness bound and number of groups per step asked for; the
weights travel by NCCL broadcast (``push.address``) between GPUs, or through
CUDA IPC where one GPU holds both sides, at the link's bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from asyncrl.launch.plan.model import Pipeline, Prediction, simulate


@dataclass(frozen=True)
class Cluster:
    """The GPUs to split and what joins them."""

    gpus: int
    hosts: int = 1
    link_gbps: float = 100.0  # between hosts, Gbit/s
    host_link_gbps: float = 1200.0  # between GPUs of one host (NVLink), Gbit/s
    gpus_per_generator: int = 1
    version_bytes: float = 0.0  # one published version of the weights

    @property
    def gpus_per_host(self) -> int:
        return max(1, self.gpus // self.hosts)


@dataclass(frozen=True)
class Rates:
    """Per-GPU speeds, samples per busy second, each side with the GPU to itself (unless ``shared``)."""

    generator_samples_per_s: float
    learner_samples_per_s: float
    shared: bool = False  # measured with both sides time-slicing one device: already each side's share


@dataclass(frozen=True)
class Option:
    """One split, simulated."""

    learner_gpus: int
    generator_gpus: int
    generators: int
    max_staleness: int
    groups_per_step: int
    transport: str
    update_s: float  # seconds to move one version to the generators
    prediction: Prediction

    @property
    def mean_staleness(self) -> float:
        return sum(s * p for s, p in self.prediction.staleness.items())

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Faster first; within 1% of each other, the fresher, then the smaller batch: less off-policy."""
        band = math.floor(math.log(max(self.prediction.achieved_samples_per_s, 1e-9)) / math.log(1.01))
        return (-band, self.mean_staleness, self.groups_per_step)


def transport(cluster: Cluster, learner_gpus: int) -> tuple[str, float]:
    """How a version reaches the generators and how many seconds it takes, from the link it crosses."""
    if cluster.gpus == 1:
        return "cuda-ipc (one GPU holds both)", 0.0
    crosses_hosts = cluster.hosts > 1 and learner_gpus < cluster.gpus
    gbps = cluster.link_gbps if crosses_hosts else cluster.host_link_gbps
    name = "push (NCCL broadcast" + (", between hosts)" if crosses_hosts else ", NVLink)")
    return name, cluster.version_bytes * 8 / (gbps * 1e9)


def learner_splits(cluster: Cluster, rates: Rates) -> list[int]:
    """Learner GPU counts to try: around the balance of the two rates, generator GPUs whole engines."""
    if cluster.gpus == 1:
        return [1]
    g, t = rates.generator_samples_per_s, rates.learner_samples_per_s
    balance = cluster.gpus * g / (g + t)
    tp = cluster.gpus_per_generator
    found = set()
    for factor in (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6):
        learner = min(cluster.gpus - tp, max(1, round(balance * factor)))
        learner = cluster.gpus - tp * max(1, (cluster.gpus - learner) // tp)
        found.add(learner)
    return sorted(found)


def on_split(base: Pipeline, cluster: Cluster, rates: Rates, learner_gpus: int) -> Pipeline:
    """``base`` (lengths, group shape, overheads) on one split of ``cluster``."""
    if cluster.gpus == 1:
        share = 1.0 if rates.shared else 0.5  # both sides on one GPU: each gets about half when both run
        return replace(
            base,
            generators=1,
            generator_samples_per_s=rates.generator_samples_per_s * share,
            learner_samples_per_s=rates.learner_samples_per_s * share,
        )
    engines = (cluster.gpus - learner_gpus) // cluster.gpus_per_generator
    _, update_s = transport(cluster, learner_gpus)
    return replace(
        base,
        generators=engines,
        generator_samples_per_s=rates.generator_samples_per_s * cluster.gpus_per_generator,
        learner_samples_per_s=rates.learner_samples_per_s * learner_gpus,
        transfer_s=update_s,
        reload_s=base.reload_s + update_s,
    )


def search(
    base: Pipeline,
    cluster: Cluster,
    rates: Rates,
    staleness: list[int],
    groups_per_step: list[int],
    steps: int = 200,
    seed: int = 0,
) -> list[Option]:
    """Every split x staleness bound x groups per step, simulated; the best first."""
    if cluster.gpus > 1 and cluster.gpus_per_generator >= cluster.gpus:
        raise ValueError(
            f"{cluster.gpus} GPUs leave none for a learner beside a {cluster.gpus_per_generator}-GPU generator"
        )
    options = []
    for learner_gpus in learner_splits(cluster, rates):
        for bound in staleness:
            for groups in groups_per_step:
                shape = replace(base, max_staleness=bound, groups_per_step=groups)
                pipe = on_split(shape, cluster, rates, learner_gpus)
                name, update_s = transport(cluster, learner_gpus)
                options.append(
                    Option(
                        learner_gpus=learner_gpus,
                        generator_gpus=cluster.gpus - learner_gpus if cluster.gpus > 1 else 1,
                        generators=pipe.generators,
                        max_staleness=bound,
                        groups_per_step=groups,
                        transport=name,
                        update_s=update_s,
                        prediction=simulate(pipe, steps, seed),
                    )
                )
    return sorted(options, key=lambda o: o.sort_key)
