"""The generator loop: ask for tickets, load new weights, sample, score, push.

One worker per generator process. Every call that can block has a timeout:
the coordinator call (``coordinator.timeout_s``, retried while the learner
restarts), the weight load (``generator.weight_load_timeout_s``), each reward
(``task.reward_timeout_s``) and the buffer write (``buffer.timeout_s``).
The parts it drives each have their own module: the conversation with the
learner (:mod:`generators.learner_link`), weight updates
(:mod:`generators.weight_updates`) and rewards (:mod:`generators.scoring`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import IO, Any

import tenacity

from asyncrl.config import RunConfig
from asyncrl.control.client import CoordinatorClient
from asyncrl.observe import trace
from asyncrl.observe.prometheus import Metric
from asyncrl.wire.protocol import EvalTicket, PromptTicket, Rollout, now_s
from buffers import BufferTimeout, RolloutWriter
from generators.base import GenerationRequest, GeneratorBackend, PromptRefused, Sample, is_stepwise, sampling_params
from generators.episode_feed import TicketFeed, group_rollouts
from generators.episodes import EpisodeRunner
from generators.learner_link import LearnerLink, Progress
from generators.scoring import Scorer
from generators.streaming import Streaming
from generators.weight_updates import WeightUpdater

log = logging.getLogger(__name__)
# Built prompts kept for tickets issued again; a few hundred MB at most, where every prompt of a large
# dataset kept for the whole run grew by gigabytes per epoch.
PROMPT_CACHE_SIZE = 4096


class GeneratorWorker:
    """Drives one backend for the lifetime of a generator process.

    ``clock`` and ``sleep`` are the time it reads and waits in (``time.monotonic``
    and ``time.sleep``); ``wait_until`` is how it waits for a reward in its
    thread (:class:`generators.base.DaemonRunner`). A test passes a fake clock's.
    """

    def __init__(
        self,
        config: RunConfig,
        generator_id: str,
        backend: GeneratorBackend,
        prompt_ids: Callable[[dict[str, Any]], list[int]],
        items: list[dict[str, Any]],
        reward_fn: Callable[[str, dict[str, Any]], float],
        client: CoordinatorClient,
        writer: RolloutWriter,
        eval_items: list[dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wait_until: Callable[[concurrent.futures.Future, float], object] | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.config = config
        self.generator_id = generator_id
        self.backend = backend
        self.items = items
        self.eval_items = eval_items or []
        self.writer = writer
        self.build_prompt = prompt_ids
        self.prompt = functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)(self.build_prompt_of)
        self.params = sampling_params(config.generator)
        self.episodes = episodes  # multi-turn tasks: every ticket's samples are episodes with an environment
        self.samples_generated = 0
        self.tokens_generated = 0  # their response tokens
        self.busy_s = 0.0
        self.produced_log: IO[str] | None = None  # one line per rollout id written to the buffer
        self.clock, self._sleep = clock, sleep
        self.link = LearnerLink(config, generator_id, client, self._progress, clock)
        self.weights = WeightUpdater(config, generator_id, backend, clock=clock)
        self.feed = TicketFeed(config, self.link, self.weights, items, clock) if episodes is not None else None
        self.scorer = Scorer(
            reward_fn,
            config.task.reward_timeout_s,
            generator_id,
            heartbeat=self.link.heartbeat,
            heartbeat_every_s=config.coordinator.generator_lease_s / 8,
            clock=clock,
            wait_until=wait_until,
        )

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called."""
        return self.link.draining

    @property
    def reward_failures(self) -> Counter[str]:
        """Rewards that failed since the start, by reason (each such rollout went out ``reward_failed``)."""
        return self.scorer.failures

    def drain(self) -> None:
        """Finish the batch in hand, then say goodbye to the learner and return from :meth:`run`.

        Work is asked for only between batches, so when :meth:`run` sees the
        flag every ticket it held has been generated and written: the learner
        has nothing to reissue. A plain flag, safe to set from a SIGTERM handler.
        """
        self.link.draining = True

    @property
    def streams(self) -> bool:
        """Whether this worker keeps its engine full (:class:`generators.streaming.Streaming`): single-turn
        work, updates in flight, and a backend that takes requests while others run."""
        return self.episodes is None and self.config.generator.update_in_flight and is_stepwise(self.backend)

    def run(self) -> None:
        """Work until the learner says stop, or until drained (:meth:`drain`)."""
        if self.streams:
            if Streaming(self).run():
                self.writer.close(linger_s=self.config.buffer.timeout_s)
                self.link.leave()
            return
        while not self.draining:
            reply = self.link.ask(self.config.generator.groups_per_request)
            if reply.stop:  # before any weight load: a learner that is done may no longer serve its weights
                self.told_to_stop(reply.reason)
                return
            self.weights.apply(reply.latest)
            if reply.eval is not None:
                self._evaluate(reply.eval)
            if not reply.tickets:
                self.idle(reply.retry_after_s)
            elif not self._work_on(reply.tickets):
                return  # the learner is done
            if self.feed is not None and self.feed.held_eval is not None:  # handed out while episodes ran
                held, self.feed.held_eval = self.feed.held_eval, None
                self._evaluate(held)
        # Every rollout written leaves this process before the goodbye: the learner settles a
        # drained generator's tickets only as their groups arrive.
        self.writer.close(linger_s=self.config.buffer.timeout_s)
        self.link.leave()

    def told_to_stop(self, reason: str) -> None:
        if reason:
            log.error("%s: told to stop: %s", self.generator_id, reason)
        else:
            log.info("%s: the learner is done; generated %d samples", self.generator_id, self.samples_generated)

    def idle(self, retry_after_s: float) -> None:
        """The learner hands out no work to a generator behind its latest version: wait for the retry (or,
        after a failed load, for that version's next try)."""
        wait_s = max(retry_after_s, self.weights.retry_at - self.clock())
        if wait_s > 0:
            with trace.span("idle"):
                self._sleep(wait_s)

    def _work_on(self, tickets: list[PromptTicket]) -> bool:
        """Generate, score and write the groups of ``tickets``; False once the learner is done."""
        index_of = {t.group_id: t.prompt_index for t in tickets}
        requests = [  # an episode's prompt is its environment's to give
            GenerationRequest(t.group_id, [] if self.episodes else self.prompt(t.prompt_index))
            for t in tickets
            if not self.link.known_refused(t)
        ]
        started = self.clock()
        self.link.lease_renewed()
        # Fakes in tests may leave updates_mid_batch out: they take updates where asked to.
        mid_batch = self.config.generator.update_in_flight and getattr(self.backend, "updates_mid_batch", True)
        between_steps = self.poll_for_update if mid_batch else self.link.heartbeat
        span_start = time.time_ns()
        for rollouts in self._groups(requests, index_of, between_steps, started):
            trace.complete("generate", span_start, time.time_ns())
            self.count(rollouts)
            if not self.push(rollouts):
                return False
            if self.link.stop_reason is not None:  # heard between two engine steps: the rest is not wanted
                self.told_to_stop(self.link.stop_reason)
                return False
            span_start = time.time_ns()
        self.busy_s += self.clock() - started
        return True

    def _groups(
        self,
        requests: list[GenerationRequest],
        index_of: dict[str, int],
        between_steps: Callable[[], None],
        started: float,
    ) -> Iterator[list[Rollout]]:
        """Each ticket's group of rollouts, scored, as soon as it is done: samples, or episodes."""
        if self.episodes is None:
            for request, samples in self._generate(requests, index_of, between_steps):
                yield self.rollouts(request, index_of[request.request_id], samples, self.clock() - started)
            return
        tickets = [(r.request_id, index_of[r.request_id], self.items[index_of[r.request_id]]) for r in requests]
        # More tickets while episodes run, where weights may change mid-batch (generator.update_in_flight).
        feed = self.feed if self.config.generator.update_in_flight else None
        if feed is not None:
            feed.start()
        refill = {"refill": feed.more, "refill_below": feed.below} if feed is not None else {}
        for _, episodes in self.episodes.run(tickets, between_steps, **refill):
            yield group_rollouts(episodes, self._score, self.config, self.generator_id, self.clock() - started)

    def poll_for_update(self) -> None:
        """Between two engine steps: take a version the learner announced since the last look (never waits)."""
        self.link.poll(self.weights.apply)

    def _generate(
        self, requests: list[GenerationRequest], index_of: dict[str, int], between_steps: Callable[[], None]
    ) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
        """The backend's groups for ``requests``; one the engine refuses (vLLM checks a prompt against its
        ``max_model_len`` as it is added, before any step) is refused alone instead of ending the process.

        Which request was refused is found by sending each alone, once: a refused prompt is remembered and
        never sent again, so only the batch that first meets it loses its batching.
        """
        if not requests:
            return
        stream = self.backend.generate(requests, self.params, between_steps)
        try:
            first = next(stream, None)
        except PromptRefused as exc:
            if len(requests) == 1:
                [request] = requests
                index = index_of[request.request_id]
                row = self.items[index].get("row", "-")
                self.link.refuse(request.request_id, index, exc, row, len(request.prompt_ids))
                return
            for request in requests:
                yield from self._generate([request], index_of, between_steps)
            return
        if first is not None:
            yield first
            yield from stream

    def rollouts(self, request: GenerationRequest, index: int, samples: list[Sample], took_s: float) -> list[Rollout]:
        item = self.items[index]
        ids = [f"{request.request_id}-{i}" for i in range(len(samples))]
        rewards = self._score(samples, item, ids)  # None where the reward failed
        return [
            Rollout(
                rollout_id=rollout_id,
                group_id=request.request_id,
                group_size=len(samples),
                prompt_index=index,
                prompt_ids=request.prompt_ids,
                response_ids=s.token_ids,
                logprobs=s.logprobs,
                versions=s.versions,
                reward=0.0 if reward is None else reward,
                reward_failed=reward is None,
                finish_reason=s.finish_reason,
                generator_id=self.generator_id,
                created_s=now_s(),
                generate_s=took_s,
            )
            for rollout_id, s, reward in zip(ids, samples, rewards)
        ]

    def _score(self, samples: list[Sample], item: dict[str, Any], ids: list[str]) -> list[float | None]:
        """The rewards of one group, rollout ids ``ids``; None where the reward failed (:meth:`Scorer.score`)."""
        return self.scorer.score(samples, item, ids)

    def push(self, rollouts: list[Rollout]) -> bool:
        """Write one group to the buffer, waiting out a full buffer; False once the learner is done.

        Each try waits up to ``buffer.timeout_s`` for room, so tries follow
        one another without a pause; between two, the learner is asked
        whether it is done (:meth:`_learner_is_done`).
        """
        groups = dict.fromkeys(r.group_id for r in rollouts)  # a group is pushed in one call
        left = list(rollouts)  # what the buffer has not taken: a try that runs out may have sent a part

        def put() -> None:
            try:
                with trace.span("buffer_put", rollouts=len(left)):
                    self.writer.put(left, self.config.buffer.timeout_s)
            except BufferTimeout as exc:
                self._log_produced(left[: exc.sent])
                del left[: exc.sent]
                raise
            self._log_produced(left)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(BufferTimeout),
            stop=self._learner_is_done,
            sleep=self._sleep,
            reraise=True,
        )
        try:
            retrying(put)
        except BufferTimeout:
            return False
        if self.writer.durable:
            self.link.written(groups)
        return True

    def _learner_is_done(self, attempt: tenacity.RetryCallState) -> bool:
        """After a write that ran out of time: whether the learner is done (and the group no longer needed).

        Otherwise a version it pushed meanwhile is taken: a push waits for every generator to join it.
        """
        log.warning("%s: %s; checking on the learner", self.generator_id, attempt.outcome.exception())
        if self.link.stop_reason is not None:  # it said so already (and may no longer answer)
            return True
        reply = self.link.ask(0)
        if not reply.stop:
            self.weights.apply(reply.latest)
        return reply.stop

    def _log_produced(self, rollouts: list[Rollout]) -> None:
        if self.produced_log is not None and rollouts:
            self.produced_log.write("".join(r.rollout_id + "\n" for r in rollouts))
            self.produced_log.flush()

    def _evaluate(self, ticket: EvalTicket) -> None:
        """Answer one piece of a held-out evaluation and report it; a failure is logged, the piece reissued later."""
        from generators.evaluate import answer_extractor, evaluate, evaluate_episodes

        started = self.clock()
        self.link.lease_renewed()
        reward, extract, between = self.scorer.reward_in_time, answer_extractor(), self.link.heartbeat
        try:
            with trace.span("evaluate", version=ticket.version, prompts=len(ticket.indices)):
                if self.episodes is not None:
                    traces = evaluate_episodes(
                        self.episodes, ticket, self.eval_items, reward, extract, between, self.params.stop
                    )
                else:
                    traces = evaluate(
                        self.backend,
                        ticket,
                        self.eval_items,
                        self.build_prompt,
                        reward,
                        extract,
                        between_steps=between,
                        stop=self.params.stop,
                    )
        except Exception as exc:  # noqa: BLE001  (evaluation must not stop generation)
            self.link.eval_failed(ticket, exc)
            return
        self.link.report_eval(ticket, traces, self.clock() - started)

    def count(self, rollouts: list[Rollout]) -> None:
        """Count ``rollouts`` as generated (each request reports the totals)."""
        self.samples_generated += len(rollouts)
        self.tokens_generated += sum(len(r.response_ids) for r in rollouts)

    def build_prompt_of(self, index: int) -> list[int]:
        return self.build_prompt(self.items[index])

    def _progress(self) -> Progress:
        return Progress(
            weight_version=self.backend.version,
            weight_session=self.weights.session,
            samples_generated=self.samples_generated,
            tokens_generated=self.tokens_generated,
            busy_s=self.busy_s,
            reward_failures=dict(self.scorer.failures),
        )

    def prometheus_metrics(self) -> list[Metric]:
        """What this generator's ``/metrics`` shows; plain numbers, read from the endpoint's thread."""
        out = [
            Metric(
                "generator_samples", "samples generated and written to the buffer", self.samples_generated, counter=True
            ),
            Metric("generator_busy_seconds", "seconds spent generating", self.busy_s, counter=True),
            Metric(
                "generator_samples_per_busy_second",
                "generation throughput while busy",
                self.samples_generated / self.busy_s if self.busy_s else 0.0,
            ),
            Metric("generator_weight_version", "the policy version this generator serves", self.backend.version),
            Metric(
                "generator_weight_update_failures",
                "weight updates that failed (the old version kept serving)",
                self.weights.failures_total,
                counter=True,
            ),
            Metric(
                "generator_refused_tickets",
                "tickets left unanswered because the engine refused their prompt",
                self.link.refused_tickets,
                counter=True,
            ),
        ]
        if self.weights.last_load_s is not None:
            out.append(
                Metric(
                    "generator_weight_load_seconds", "seconds the latest weight update took", self.weights.last_load_s
                )
            )
        return out
