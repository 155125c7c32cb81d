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
  (samples per busy second, over the run) sets the time per token.
  ``length_scale`` moves the mean length phase by phase (a run's
  ``response_len`` over its steps, relative to its mean; the phases are
  spread evenly over the simulated steps), so a run whose answers shrank as
  it learned is played slow first and fast later, not at its average.
* The learner takes ``groups_per_step`` groups in arrival order, drops a
  sample over the bound (its slot goes back, as :meth:`StalenessBound.release`
  does), steps, publishes, and spends ``learner_overhead_s`` on its records
  before the next batch. A step's time has a part that grows with the batch's
  response tokens and ``learner_fixed_share`` that does not (prompt tokens,
  the optimizer, the publish), at the mean length.
* A published version reaches generators ``transfer_s`` later; loading it
  pauses a generator for ``reload_s``.
* Every ``eval_every_steps`` versions, from version 0, a held-out evaluation
  of ``eval_prompts`` prompts (a greedy answer and ``eval_k`` samples each)
  is cut into pieces of ``eval_prompts_per_piece``. A batch generator takes
  one piece with each request and answers it first, a greedy batch and a
  sampled one, each as long as its longest answer: the plain loop did this,
  so an evaluation holds training back one request at a time. A streaming
  generator runs a piece's answers beside its training groups, in its lanes.
  Under ``eval_max_share`` (``eval.max_share``) pieces after version 0's
  wait for the tickets handed out to earn them (version 0's go out at once
  and are charged too), and an evaluation none of whose pieces was taken
  gives way to the next, as the learner does it. The learner's budget is in
  tokens; here every answer of a phase is as long, so sequences stand in.
* ``jitter`` holds factors of mean 1 (a run's own step times over what its
  tokens predict): each learner step and each generator batch or group is
  drawn one, so a machine whose speed wanders is played with the same
  spread. The factors are what make a fast step find the buffer empty.

Capacities and efficiency are computed the way ``summary.json`` computes them,
so a prediction and a run's summary compare like for like.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import simpy

from asyncrl.control.evaluation import earned_per_training
from asyncrl.launch.plan.lengths import Lengths

__all__ = ["Lengths", "Pipeline", "Prediction", "simulate"]


@dataclass(frozen=True)
class Pipeline:
    """One run's shape and measured speeds: what the simulation needs to play it.

    ``generator_samples_per_s`` is one generator's rate while busy and
    ``learner_samples_per_s`` the learner's while stepping and publishing, as
    ``summary.json`` counts them: averages over the run, and so over its
    length phases.
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
    length_scale: tuple[float, ...] = ()  # mean length of each phase over the run's mean; () is one phase
    learner_fixed_share: float = 0.0
    eval_every_steps: int = 0
    eval_prompts: int = 0
    eval_k: int = 0
    eval_prompts_per_piece: int = 0  # 0: the whole evaluation in one piece
    eval_max_share: float = 0.0  # eval.max_share: 0, no budget
    publish_every_steps: int = 1  # learner.publish_every_steps: a version every this many steps

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.groups_per_step

    @property
    def samples_per_version(self) -> int:
        """What the staleness bound admits per version (StalenessBound's ``samples_per_version``)."""
        return self.samples_per_step * self.publish_every_steps

    @property
    def lanes(self) -> int:
        return self.groups_in_flight or self.groups_per_request

    def phases(self) -> list[Lengths]:
        """The lengths of each phase: ``lengths`` moved to each ``length_scale`` times its mean."""
        if not self.length_scale:
            return [self.lengths]
        mean = self.lengths.mean()
        return [self.lengths.with_mean(scale * mean) for scale in self.length_scale]


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


@functools.lru_cache(maxsize=4096)
def _expected_longest(lengths: Lengths, n: int) -> float:
    """The mean of the longest of ``n`` drawn lengths (drawn with its own seed: an expectation, not a draw)."""
    trials = max(100, 100_000 // n)
    return float(lengths.draw(np.random.default_rng(0), (trials, n)).max(axis=1).mean())


@dataclass
class _Group:
    version: int  # the oldest weights that sampled it
    tokens: float


@dataclass
class _State:
    """What the processes share: the versions, the bound's count, the buffer, the phases and the tallies."""

    env: simpy.Environment
    pipe: Pipeline
    rng: np.random.Generator
    steps: int
    phases: list[Lengths]
    per_token_s: float = 0.0
    version: int = 0  # the learner's latest
    step: int = 0  # the learner's steps so far
    visible: int = 0  # the latest a generator can load
    admitted: int = 0
    arrived: deque = field(default_factory=deque)
    pieces: deque = field(default_factory=deque)  # the version of each evaluation piece not yet taken
    begun: set = field(default_factory=set)  # versions whose evaluation has a piece taken
    credit: float = 0.0  # under eval_max_share: evaluation sequences earned and not yet spent
    generated: list = field(default_factory=list)  # per generator: [samples, busy_s]
    staleness: Counter = field(default_factory=Counter)
    dropped: int = 0

    def __post_init__(self) -> None:
        self.published = self.env.event()
        self.delivered = self.env.event()
        self.open_evaluation(0)

    def jitter(self) -> float:
        return float(self.rng.choice(self.pipe.jitter)) if self.pipe.jitter else 1.0

    def lengths(self) -> Lengths:
        """The lengths of the phase the learner is in."""
        return self.phases[min(len(self.phases) - 1, self.step * len(self.phases) // self.steps)]

    def admit(self, weights: int, groups: int) -> int:
        limit = (weights + self.pipe.max_staleness + 1) * self.pipe.samples_per_version
        granted = max(0, min(groups, (limit - self.admitted) // self.pipe.group_size))
        self.admitted += granted * self.pipe.group_size
        earn = earned_per_training(self.pipe.eval_max_share)
        if earn is not None:  # as EvalBook.generated: kept to one piece's worth while nothing waits
            self.credit += granted * self.pipe.group_size * earn
            if not self.pieces:
                self.credit = min(self.credit, self._piece_prompts() * (1 + self.pipe.eval_k))
        return granted

    def deliver(self, group: _Group) -> None:
        self.arrived.append(group)
        self.delivered.succeed()
        self.delivered = self.env.event()

    def open_evaluation(self, version: int) -> None:
        pipe = self.pipe
        if pipe.eval_every_steps and pipe.eval_prompts and version % pipe.eval_every_steps == 0:
            if pipe.eval_max_share:  # an evaluation not begun gives way (version 0's runs in full)
                self.pieces = deque(v for v in self.pieces if v == 0 or v in self.begun)
            size = pipe.eval_prompts_per_piece or pipe.eval_prompts
            self.pieces.extend([version] * math.ceil(pipe.eval_prompts / size))

    def _piece_prompts(self) -> int:
        return min(self.pipe.eval_prompts_per_piece or self.pipe.eval_prompts, self.pipe.eval_prompts)

    def take_piece(self, weights: int) -> int:
        """Prompts of the oldest evaluation piece a generator holding ``weights`` may answer; 0 if none."""
        if not self.pieces or self.pieces[0] > weights:
            return 0
        charged = self.pipe.eval_max_share > 0
        if charged and self.pieces[0] > 0 and self.credit <= 0:  # version 0's goes out without credit
            return 0
        self.begun.add(self.pieces.popleft())
        if charged:
            self.credit -= self._piece_prompts() * (1 + self.pipe.eval_k)
        return self._piece_prompts()

    def make_visible(self, version: int):
        yield self.env.timeout(self.pipe.transfer_s)
        self.visible = max(self.visible, version)
        self.published.succeed()
        self.published = self.env.event()


def _time_per_token(pipe: Pipeline, phases: list[Lengths]) -> float:
    """Seconds per token of the slowest response in a full batch, fixed so the busy rate is the measured one.

    A batch lasts as long as its longest response, so the measured rate is
    samples per (expected longest length x this time), the expectation taken
    over the phases, which hold equal shares of the samples.
    """
    per_batch = pipe.group_size * pipe.lanes
    longest = pipe.group_size if pipe.streaming else per_batch  # a streaming group ends with its own longest
    mean_longest = float(np.mean([_expected_longest(lengths, longest) for lengths in phases]))
    return per_batch / pipe.generator_samples_per_s / mean_longest


def _batch_generator(state: _State, index: int):
    """The plain loop: ask, load the latest version, answer an evaluation piece, sample the groups together."""
    env, pipe = state.env, state.pipe
    weights = 0
    while True:
        if state.visible > weights:
            yield env.timeout(pipe.reload_s)
            weights = state.visible
        prompts = state.take_piece(weights)
        granted = state.admit(weights, pipe.groups_per_request)
        if prompts:  # greedy answers as one batch, then the k samples as another
            lengths = state.lengths()
            longest = _expected_longest(lengths, prompts) + _expected_longest(lengths, prompts * pipe.eval_k)
            yield env.timeout(longest * state.per_token_s * state.jitter())
        if not granted:
            if not prompts and state.visible == weights:  # else a version came out meanwhile: take it first
                yield state.published
            continue
        lengths = state.lengths().draw(state.rng, (granted, pipe.group_size))
        took = float(lengths.max()) * state.per_token_s * state.jitter()
        yield env.timeout(took)
        state.generated[index][0] += granted * pipe.group_size
        state.generated[index][1] += took
        for row in lengths:
            state.deliver(_Group(weights, float(row.sum())))


def _streaming_generator(state: _State, index: int):
    """An engine kept full: up to ``groups_in_flight`` groups, each sent as it ends, new weights between steps."""
    env, pipe = state.env, state.pipe
    in_flight = [0]
    ended = [env.event()]
    loaded = [0]

    def run_group(weights: int, pause: float, training: bool):
        lengths = state.lengths().draw(state.rng, pipe.group_size)
        took = float(lengths.max()) * state.per_token_s * state.jitter()
        yield env.timeout(took + pause)
        in_flight[0] -= 1
        if training:  # each group holds one of the engine's lanes: busy time is the lanes' over their number
            state.generated[index][0] += pipe.group_size
            state.generated[index][1] += took / pipe.lanes
            state.deliver(_Group(weights, float(lengths.sum())))
        ended[0].succeed()
        ended[0] = env.event()

    while True:
        pause = pipe.reload_s if state.visible > loaded[0] else 0.0
        loaded[0] = state.visible
        prompts = state.take_piece(loaded[0]) if in_flight[0] < pipe.lanes else 0
        # A piece's greedy and sampled answers, in groups' worth, take lanes beside the training groups.
        for _ in range(math.ceil(prompts * (1 + pipe.eval_k) / pipe.group_size)):
            in_flight[0] += 1
            env.process(run_group(loaded[0], pause, training=False))
        granted = state.admit(loaded[0], pipe.lanes - in_flight[0]) if in_flight[0] < pipe.lanes else 0
        for _ in range(granted):
            in_flight[0] += 1
            env.process(run_group(loaded[0], pause, training=True))
        if not granted and not prompts:
            yield ended[0] | state.published


def _learner(state: _State, timings: dict):
    """Take a step's groups in arrival order, drop what the bound forbids, step, publish, keep records."""
    env, pipe = state.env, state.pipe
    per_sample_s = 1.0 / pipe.learner_samples_per_s
    # The mean length over the simulated steps, phase by phase: the tokens the measured rate was counted at.
    mean_tokens = float(
        np.mean([state.phases[k * len(state.phases) // state.steps].mean() for k in range(state.steps)])
    )
    fixed = pipe.learner_fixed_share
    for step in range(state.steps):
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
        tokens = sum(g.tokens for g in batch) / pipe.samples_per_step / mean_tokens
        took = pipe.samples_per_step * per_sample_s * (fixed + (1 - fixed) * tokens) * state.jitter()
        for group in batch:
            state.staleness[state.version - group.version] += pipe.group_size
        yield env.timeout(took)
        timings["busy"] += took
        state.step += 1
        if state.step % pipe.publish_every_steps == 0:
            state.version += 1
            state.open_evaluation(state.version)
            env.process(state.make_visible(state.version))
        timings["end"] = env.now
        yield env.timeout(pipe.learner_overhead_s)


def simulate(pipe: Pipeline, steps: int = 400, seed: int = 0) -> Prediction:
    """Play ``steps`` learner steps of ``pipe`` and measure them as a run's summary would; same seed, same result."""
    if pipe.generators < 1 or pipe.generator_samples_per_s <= 0 or pipe.learner_samples_per_s <= 0:
        raise ValueError("a pipeline needs at least one generator and rates above 0")
    env = simpy.Environment()
    phases = pipe.phases()
    generated = [[0, 0.0] for _ in range(pipe.generators)]
    state = _State(env, pipe, np.random.default_rng(seed), steps, phases, generated=generated)
    state.per_token_s = _time_per_token(pipe, phases)
    generator = _streaming_generator if pipe.streaming else _batch_generator
    for index in range(pipe.generators):
        env.process(generator(state, index))
    timings = {"start": 0.0, "end": 0.0, "busy": 0.0, "wait": 0.0}
    env.run(until=env.process(_learner(state, timings)))
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
