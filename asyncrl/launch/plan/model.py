"""A discrete-event simulation of one run's pipeline: generators, the staleness bound, the learner, weight updates.

It answers what a run of a given shape would train per second and how stale
its samples would be, before any GPU is spent. The parts follow the product:

* A generator asks for up to ``groups_per_request`` groups, and the staleness
  bound admits sample number ``k`` to weights ``w`` only while
  ``k < (w + max_staleness + 1) * samples_per_version``
  (:class:`asyncrl.control.staleness.StalenessBound`). A generator refused
  work waits for the next version, as the learner's long poll makes it.
* A batch generator (``streaming=False``: the plain loop, and every engine
  on a CPU) samples a request's groups together; the request lasts as long as
  its longest response. A streaming one (vLLM on a GPU) keeps
  ``groups_in_flight`` groups going and sends each as it finishes.
* Response lengths are drawn from :class:`Lengths`, so the measured rate
  (samples per busy second, at the mean length) sets the time per token.
* The learner takes ``groups_per_step`` groups in arrival order, drops a
  sample over the bound (its slot goes back, as :meth:`StalenessBound.release`
  does), steps for a time that grows with the batch's tokens, publishes, and
  spends ``learner_overhead_s`` on its records before the next batch.
* A published version reaches generators ``transfer_s`` later; loading it
  pauses a generator for ``reload_s``.
* Every ``eval_every_steps`` versions the generators answer a held-out
  evaluation, ``eval_s`` of generation shared among them, before more
  training work: the learner waits unless the bound let enough be buffered.
* ``jitter`` holds factors of mean 1 (a run's own step times over their mean):
  each learner step and each generator batch or group is drawn one, so a
  machine whose speed wanders is played with the same spread. The factors are
  what make a fast step find the buffer empty.

Capacities and efficiency are computed the way ``summary.json`` computes them,
so a prediction and a run's summary compare like for like.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import simpy


@dataclass(frozen=True)
class Lengths:
    """Response lengths in tokens: an empirical histogram, or a lognormal cut off at ``max_tokens``."""

    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    mean_tokens: float = 0.0
    max_tokens: int = 0
    sigma: float = 0.8

    @classmethod
    def histogram(cls, counts: dict[int, float]) -> Lengths:
        """Lengths drawn in proportion to ``counts`` (length -> how many samples had it)."""
        kept = {int(k): float(v) for k, v in counts.items() if v > 0}
        if not kept:
            raise ValueError("a length histogram needs at least one length with a count above 0")
        total = sum(kept.values())
        return cls(values=tuple(kept), weights=tuple(v / total for v in kept.values()))

    @classmethod
    def lognormal(cls, mean_tokens: float, max_tokens: int, sigma: float = 0.8) -> Lengths:
        """Lengths with this mean before the cut; those past ``max_tokens`` are truncated to it, as generation is."""
        if not 0 < mean_tokens <= max_tokens:
            raise ValueError(f"mean length {mean_tokens} must be above 0 and at most the max length {max_tokens}")
        return cls(mean_tokens=mean_tokens, max_tokens=max_tokens, sigma=sigma)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths, at least one token each."""
        if self.values:
            return rng.choice(np.array(self.values), size=n, p=np.array(self.weights))
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, size=n)), 1, self.max_tokens)

    def mean(self) -> float:
        """The mean length, truncation included (by drawing, for the lognormal)."""
        if self.values:
            return float(np.dot(self.values, self.weights))
        return float(self.draw(np.random.default_rng(0), 20_000).mean())


@dataclass(frozen=True)
class Pipeline:
    """One run's shape and measured speeds: what the simulation needs to play it.

    ``generator_samples_per_s`` is one generator's rate while busy and
    ``learner_samples_per_s`` the learner's while stepping and publishing, as
    ``summary.json`` counts them.
    """

    generators: int
    generator_samples_per_s: float
    learner_samples_per_s: float
    max_staleness: int
    group_size: int
    groups_per_step: int
    groups_per_request: int
    lengths: Lengths
    streaming: bool = False
    groups_in_flight: int = 0  # per streaming generator; 0: groups_per_request
    learner_overhead_s: float = 0.0
    transfer_s: float = 0.0
    reload_s: float = 0.0
    jitter: tuple[float, ...] = ()
    eval_every_steps: int = 0
    eval_s: float = 0.0

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.groups_per_step


@dataclass
class Prediction:
    """What a simulated run measured, named as ``summary.json`` names it."""

    steps: int
    wall_s: float
    samples_consumed: int
    achieved_samples_per_s: float
    generator_capacity_samples_per_s: float
    learner_capacity_samples_per_s: float
    pipeline_efficiency: float
    staleness: dict[int, float]  # staleness -> share of the samples trained on
    samples_dropped: int
    learner_wait_s: float

    def histogram(self, max_staleness: int) -> list[float]:
        """The staleness shares as a list, index = staleness, 0 to ``max_staleness``."""
        return [self.staleness.get(s, 0.0) for s in range(max_staleness + 1)]


@dataclass
class _Group:
    version: int  # the oldest weights that sampled it
    tokens: float


@dataclass
class _State:
    """What the processes share: the versions, the bound's count, the buffer and the tallies."""

    env: simpy.Environment
    pipe: Pipeline
    rng: np.random.Generator
    version: int = 0  # the learner's latest
    visible: int = 0  # the latest a generator can load
    admitted: int = 0
    arrived: deque = field(default_factory=deque)
    generated: list = field(default_factory=list)  # per generator: [samples, busy_s]
    staleness: Counter = field(default_factory=Counter)
    dropped: int = 0

    def __post_init__(self) -> None:
        self.published = self.env.event()
        self.delivered = self.env.event()

    def jitter(self) -> float:
        return float(self.rng.choice(self.pipe.jitter)) if self.pipe.jitter else 1.0

    def admit(self, weights: int, groups: int) -> int:
        limit = (weights + self.pipe.max_staleness + 1) * self.pipe.samples_per_step
        granted = max(0, min(groups, (limit - self.admitted) // self.pipe.group_size))
        self.admitted += granted * self.pipe.group_size
        return granted

    def deliver(self, group: _Group) -> None:
        self.arrived.append(group)
        self.delivered.succeed()
        self.delivered = self.env.event()

    def make_visible(self, version: int):
        yield self.env.timeout(self.pipe.transfer_s)
        self.visible = max(self.visible, version)
        self.published.succeed()
        self.published = self.env.event()


def _time_per_token(pipe: Pipeline, rng: np.random.Generator) -> float:
    """Seconds per token of the slowest response in a full batch, fixed so the busy rate is the measured one.

    A batch lasts as long as its longest response, so the measured rate is
    samples per (expected longest length x this time).
    """
    per_batch = pipe.group_size * (pipe.groups_in_flight or pipe.groups_per_request)
    if pipe.streaming:  # each group ends with its own longest response
        draws = pipe.lengths.draw(rng, (2000, pipe.group_size)).max(axis=1)
    else:
        draws = pipe.lengths.draw(rng, (500, per_batch)).max(axis=1)
    return per_batch / pipe.generator_samples_per_s / float(draws.mean())


def _evaluations(pipe: Pipeline, old: int, new: int) -> float:
    """One generator's share of the evaluations due at versions ``old + 1`` to ``new``, in seconds."""
    if not pipe.eval_every_steps:
        return 0.0
    due = new // pipe.eval_every_steps - old // pipe.eval_every_steps
    return due * pipe.eval_s / pipe.generators


def _batch_generator(state: _State, index: int, per_token_s: float):
    """The plain loop: ask, load the latest version, sample the request's groups together, send them."""
    env, pipe = state.env, state.pipe
    weights = 0
    while True:
        if state.visible > weights:
            yield env.timeout(pipe.reload_s)
            yield env.timeout(_evaluations(pipe, weights, state.visible))
            weights = state.visible
        granted = state.admit(weights, pipe.groups_per_request)
        if not granted:
            if state.visible == weights:  # else a version came out while this one loaded: take it first
                yield state.published
            continue
        lengths = pipe.lengths.draw(state.rng, (granted, pipe.group_size))
        took = float(lengths.max()) * per_token_s * state.jitter()
        yield env.timeout(took)
        state.generated[index][0] += granted * pipe.group_size
        state.generated[index][1] += took
        for row in lengths:
            state.deliver(_Group(weights, float(row.sum())))


def _streaming_generator(state: _State, index: int, per_token_s: float):
    """An engine kept full: up to ``groups_in_flight`` groups, each sent as it ends, new weights between steps."""
    env, pipe = state.env, state.pipe
    lanes = pipe.groups_in_flight or pipe.groups_per_request
    in_flight = [0]
    ended = [env.event()]
    loaded = [0]

    def run_group(weights: int, reload: float):
        lengths = pipe.lengths.draw(state.rng, pipe.group_size)
        took = float(lengths.max()) * per_token_s * state.jitter()
        yield env.timeout(took + reload)
        # Each group holds one of the engine's lanes: busy time is the lanes' time over how many there are.
        state.generated[index][0] += pipe.group_size
        state.generated[index][1] += took / lanes
        in_flight[0] -= 1
        state.deliver(_Group(weights, float(lengths.sum())))
        ended[0].succeed()
        ended[0] = env.event()

    while True:
        granted = state.admit(state.visible, lanes - in_flight[0]) if in_flight[0] < lanes else 0
        reload = pipe.reload_s + _evaluations(pipe, loaded[0], state.visible) if state.visible > loaded[0] else 0.0
        loaded[0] = state.visible
        for _ in range(granted):
            in_flight[0] += 1
            env.process(run_group(state.visible, reload))
        if not granted:
            yield ended[0] | state.published


def _learner(state: _State, steps: int, timings: dict):
    """Take a step's groups in arrival order, drop what the bound forbids, step, publish, keep records."""
    env, pipe = state.env, state.pipe
    per_sample_s = 1.0 / pipe.learner_samples_per_s
    mean_tokens = pipe.lengths.mean()
    for step in range(steps):
        batch: list[_Group] = []
        waited = env.now
        while len(batch) < pipe.groups_per_step:
            if not state.arrived:
                yield state.delivered
                continue
            group = state.arrived.popleft()
            if state.version - group.version > pipe.max_staleness:
                state.admitted -= pipe.group_size
                state.dropped += pipe.group_size
            else:
                batch.append(group)
        if step == 0:
            timings["start"] = env.now
        else:
            timings["wait"] += env.now - waited
        tokens = sum(g.tokens for g in batch) / pipe.samples_per_step
        took = pipe.samples_per_step * per_sample_s * tokens / mean_tokens * state.jitter()
        for group in batch:
            state.staleness[state.version - group.version] += pipe.group_size
        yield env.timeout(took)
        timings["busy"] += took
        state.version += 1
        env.process(state.make_visible(state.version))
        timings["end"] = env.now
        yield env.timeout(pipe.learner_overhead_s)


def simulate(pipe: Pipeline, steps: int = 400, seed: int = 0) -> Prediction:
    """Play ``steps`` learner steps of ``pipe`` and measure them as a run's summary would; same seed, same result."""
    if pipe.generators < 1 or pipe.generator_samples_per_s <= 0 or pipe.learner_samples_per_s <= 0:
        raise ValueError("a pipeline needs at least one generator and rates above 0")
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    state = _State(env, pipe, rng, generated=[[0, 0.0] for _ in range(pipe.generators)])
    per_token_s = _time_per_token(pipe, rng)
    generator = _streaming_generator if pipe.streaming else _batch_generator
    for index in range(pipe.generators):
        env.process(generator(state, index, per_token_s))
    timings = {"start": 0.0, "end": 0.0, "busy": 0.0, "wait": 0.0}
    env.run(until=env.process(_learner(state, steps, timings)))
    consumed = steps * pipe.samples_per_step
    wall_s = timings["end"] - timings["start"]
    achieved = consumed / wall_s
    generator_capacity = sum(n / busy for n, busy in state.generated if busy > 0)
    learner_capacity = consumed / timings["busy"]
    return Prediction(
        steps=steps,
        wall_s=wall_s,
        samples_consumed=consumed,
        achieved_samples_per_s=achieved,
        generator_capacity_samples_per_s=generator_capacity,
        learner_capacity_samples_per_s=learner_capacity,
        pipeline_efficiency=achieved / min(generator_capacity, learner_capacity),
        staleness={s: n / consumed for s, n in sorted(state.staleness.items())},
        samples_dropped=state.dropped,
        learner_wait_s=timings["wait"],
    )
