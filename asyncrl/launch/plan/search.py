"""Ways to split a cluster between generators and learner, each played by the simulation, best first.

A split gives ``learner_gpus`` to the learner (its rate grows in proportion,
which ZeRO-3 data parallelism approaches at a fixed batch per GPU) and the
rest to generator engines of ``gpus_per_generator`` GPUs each. Every split is
tried with each staleness bound and number of groups per step asked for, or,
unless asked, numbers that grow with the split's engines. The weights travel
by NCCL broadcast (``push.address``) between GPUs, or through CUDA IPC where
one GPU holds both sides, at the link's bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from asyncrl.launch.plan.model import Pipeline, Prediction, simulate

# A big cluster is played shrunk to about this many groups per step, with at least this many engines.
STEP_GROUPS = 256
MIN_ENGINES = 16


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


def check_cluster(cluster: Cluster) -> None:
    """Refuse a cluster no split can use, naming the setting that makes it so."""
    tp, per_host = cluster.gpus_per_generator, cluster.gpus_per_host
    if cluster.gpus == 1 and tp > 1:
        raise ValueError(f"--gpus-per-generator {tp}: one GPU holds a generator of one GPU beside the learner")
    if tp > per_host:
        raise ValueError(
            f"--gpus-per-generator {tp}: a generator's GPUs are on one host, and each of the {cluster.hosts} hosts "
            f"has {per_host} ({cluster.gpus} GPUs over {cluster.hosts})"
        )
    if cluster.gpus > 1 and engines_beside(cluster, 1) == 0:
        raise ValueError(f"{cluster.gpus} GPUs leave none for a learner beside a {tp}-GPU generator")


def transport(cluster: Cluster, learner_gpus: int) -> tuple[str, float]:
    """How a version reaches the generators and how many seconds it takes, from the link it crosses."""
    if cluster.gpus == 1:
        return "cuda-ipc (one GPU holds both)", 0.0
    crosses_hosts = cluster.hosts > 1 and learner_gpus < cluster.gpus
    gbps = cluster.link_gbps if crosses_hosts else cluster.host_link_gbps
    name = "push (NCCL broadcast" + (", between hosts)" if crosses_hosts else ", NVLink)")
    return name, cluster.version_bytes * 8 / (gbps * 1e9)


def engines_beside(cluster: Cluster, learner_gpus: int) -> int:
    """Generator engines that fit beside a learner of ``learner_gpus`` GPUs.

    The learner fills hosts first; an engine's GPUs are on one host (vLLM's
    tensor parallelism stays within a node), so GPUs a host has left over
    short of a whole engine stay idle.
    """
    left, engines = learner_gpus, 0
    for _ in range(cluster.hosts):
        taken = min(cluster.gpus_per_host, left)
        left -= taken
        engines += (cluster.gpus_per_host - taken) // cluster.gpus_per_generator
    return engines


def learner_splits(cluster: Cluster, rates: Rates) -> list[int]:
    """Learner GPU counts to try: around the balance of the two rates, each taking every GPU the engines leave."""
    if cluster.gpus == 1:
        return [1]
    g, t = rates.generator_samples_per_s, rates.learner_samples_per_s
    balance = cluster.gpus * g / (g + t)
    found = set()
    for factor in (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6):
        learner = min(cluster.gpus - 1, max(1, round(balance * factor)))
        while learner > 1 and engines_beside(cluster, learner) == 0:
            learner -= 1
        engines = engines_beside(cluster, learner)
        while learner + 1 < cluster.gpus and engines_beside(cluster, learner + 1) == engines:
            learner += 1  # a GPU no engine can use goes to the learner
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
    engines = engines_beside(cluster, learner_gpus)
    _, update_s = transport(cluster, learner_gpus)
    return replace(
        base,
        generators=engines,
        generator_samples_per_s=rates.generator_samples_per_s * cluster.gpus_per_generator,
        learner_samples_per_s=rates.learner_samples_per_s * learner_gpus,
        transfer_s=update_s,
        reload_s=base.reload_s + update_s,
    )


def groups_per_step_choices(base: Pipeline, engines: int, bound: int) -> list[int]:
    """Powers of two from below half to above twice the groups per step whose window holds the engines' work.

    The bound admits ``(bound + 1) x groups_per_step`` groups at once; fewer
    than the ``engines x lanes`` the engines could run leaves engines idle
    however fast they are, and many more only makes samples older. So the
    choices grow with the cluster: 512 GPUs need thousands of groups in flight.
    """
    need = engines * base.lanes / (bound + 1)
    low = 2 ** max(0, math.floor(math.log2(max(1.0, need / 2))))
    high = 2 ** math.ceil(math.log2(max(1.0, need * 2)))
    return [2**k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)]


def _steps_for(pipe: Pipeline, steps: int) -> int:
    """Fewer steps where each holds many groups (a step of thousands already averages over the length tails),
    and never fewer than ten bounds' worth, by which the pipeline has filled."""
    return max(10 * (pipe.max_staleness + 1), min(steps, steps * 64 // max(1, pipe.groups_per_step)))


def _scaled_down(pipe: Pipeline, groups: int = STEP_GROUPS) -> tuple[Pipeline, float]:
    """The same pipeline shrunk to about ``groups`` groups per step, and the factor it was shrunk by.

    Engines, learner rate and groups per step shrink together, so a step
    lasts as long, the bound admits the same share of what the engines can
    run and the samples age the same: efficiency and staleness keep, and
    samples/s scale back by the factor. The engines are rounded to whole ones
    (at least :data:`MIN_ENGINES`, so by at most a few percent) and the
    engines' rate set so their sum shrinks exactly by the factor.
    """
    factor = min(pipe.groups_per_step // groups, pipe.generators // MIN_ENGINES)
    if factor < 2:
        return pipe, 1.0
    steps_groups = round(pipe.groups_per_step / factor)
    exact = pipe.groups_per_step / steps_groups
    engines = max(1, round(pipe.generators / exact))
    small = replace(
        pipe,
        generators=engines,
        groups_per_step=steps_groups,
        generator_samples_per_s=pipe.generator_samples_per_s * pipe.generators / exact / engines,
        learner_samples_per_s=pipe.learner_samples_per_s / exact,
    )
    return small, exact


def _grown(prediction: Prediction, factor: float) -> Prediction:
    """A scaled-down pipeline's prediction, its sample counts and rates multiplied back."""
    if factor == 1.0:
        return prediction
    return replace(
        prediction,
        samples_consumed=round(prediction.samples_consumed * factor),
        achieved_samples_per_s=prediction.achieved_samples_per_s * factor,
        generator_capacity_samples_per_s=prediction.generator_capacity_samples_per_s * factor,
        learner_capacity_samples_per_s=prediction.learner_capacity_samples_per_s * factor,
        samples_dropped=round(prediction.samples_dropped * factor),
    )


def _option(
    base: Pipeline, cluster: Cluster, rates: Rates, learner_gpus: int, shape: dict, steps: int, seed: int
) -> Option:
    """One split and shape, simulated (shrunk where it is big)."""
    pipe = on_split(replace(base, **shape), cluster, rates, learner_gpus)
    name, update_s = transport(cluster, learner_gpus)
    small, factor = _scaled_down(pipe)
    return Option(
        learner_gpus=learner_gpus,
        generator_gpus=pipe.generators * cluster.gpus_per_generator if cluster.gpus > 1 else 1,
        generators=pipe.generators,
        max_staleness=pipe.max_staleness,
        groups_per_step=pipe.groups_per_step,
        transport=name,
        update_s=update_s,
        prediction=_grown(simulate(small, _steps_for(small, steps), seed), factor),
    )


def search(
    base: Pipeline,
    cluster: Cluster,
    rates: Rates,
    staleness: list[int],
    groups_per_step: list[int] | None = None,
    steps: int = 200,
    seed: int = 0,
    keep_splits: int = 3,
) -> list[Option]:
    """Every split x staleness bound x groups per step worth trying, simulated; the best first.

    ``groups_per_step`` None: :func:`groups_per_step_choices` for each split
    and bound. Coarse to fine: every split is first played with each bound at
    the middle choice and a quarter of the steps, and only the
    ``keep_splits`` fastest splits are played with every choice.
    """
    check_cluster(cluster)

    def choices(learner_gpus: int, bound: int) -> list[int]:
        if groups_per_step:
            return list(groups_per_step)
        engines = on_split(base, cluster, rates, learner_gpus).generators
        return groups_per_step_choices(base, engines, bound)

    splits = learner_splits(cluster, rates)
    options: dict[tuple[int, int, int], Option] = {}
    if len(splits) > keep_splits:
        for learner_gpus in splits:
            for bound in staleness:
                found = choices(learner_gpus, bound)
                groups = found[len(found) // 2]
                shape = {"max_staleness": bound, "groups_per_step": groups}
                coarse = _option(base, cluster, rates, learner_gpus, shape, steps // 4, seed)
                options[learner_gpus, bound, groups] = coarse
        best: dict[int, float] = {}
        for (learner_gpus, _, _), option in options.items():
            best[learner_gpus] = max(best.get(learner_gpus, 0.0), option.prediction.achieved_samples_per_s)
        splits = sorted(splits, key=lambda n: -best[n])[:keep_splits]
    played = []
    for learner_gpus in splits:
        for bound in staleness:
            for groups in choices(learner_gpus, bound):
                shape = {"max_staleness": bound, "groups_per_step": groups}
                played.append(_option(base, cluster, rates, learner_gpus, shape, steps, seed))
    return sorted(played, key=lambda o: o.sort_key)
