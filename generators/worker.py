"""The generator loop: ask for tickets, load new weights, sample, score, push.

One worker per generator process. Every call that can block has a timeout:
the coordinator call (``coordinator.timeout_s``, retried while the learner
restarts), the weight load (``generator.weight_load_timeout_s``) and the
buffer write (``buffer.timeout_s``).
"""

from __future__ import annotations

import functools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import IO, Any

from asyncrl.config import RunConfig
from asyncrl.control.client import CoordinatorClient, RemoteError, wait_for_reply
from asyncrl.observe import trace
from asyncrl.observe.prometheus import Metric
from asyncrl.tasks.rewards import as_reward
from asyncrl.weights.shared import superseded
from asyncrl.weights.transports import open_receiver
from asyncrl.wire.protocol import (
    Ack,
    EvalReport,
    EvalTicket,
    PromptTicket,
    Rollout,
    WeightUpdate,
    WorkReply,
    WorkRequest,
    now_s,
)
from buffers import BufferTimeout, RolloutWriter
from generators.base import (
    Abandoned,
    DaemonRunner,
    GenerationRequest,
    GeneratorBackend,
    PromptRefused,
    Sample,
    SamplingParams,
)

log = logging.getLogger(__name__)
# Shared weights: say so when this many versions in a row were overwritten before this generator copied them.
SUPERSEDED_WARN_EVERY = 10
# Built prompts kept for tickets issued again; a few hundred MB at most, where every prompt of a large
# dataset kept for the whole run grew by gigabytes per epoch.
PROMPT_CACHE_SIZE = 4096


class GeneratorWorker:
    """Drives one backend for the lifetime of a generator process."""

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
    ) -> None:
        self.config = config
        self.eval_items = eval_items or []
        self.generator_id = generator_id
        self.backend = backend
        self.items = items
        self.reward_fn = reward_fn
        self.client = client
        self.writer = writer
        self._build_prompt = prompt_ids
        self._prompt = functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)(self._build_prompt_of)
        gen = config.generator
        self.params = SamplingParams(
            n=gen.samples_per_prompt,
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            stop=tuple(gen.stop),
        )
        self.samples_generated = 0
        self.busy_s = 0.0
        self.failed_updates = 0
        self.failed_updates_total = 0
        # A version whose load failed is tried again only from this time.monotonic() on (a backoff that never
        # sleeps in the engine loop: mid-batch, the batch goes on meanwhile).
        self._failed_update: WeightUpdate | None = None
        self._retry_update_at = 0.0
        self.superseded_in_a_row = 0
        self.last_load_s: float | None = None
        self._last_poll = time.monotonic()  # when this generator last asked the learner anything
        self.receiver = open_receiver(config, generator_id)
        self.reward_failures: Counter[str] = Counter()
        # Prompts the engine refused (index -> its reason), never sent to it again, and tickets left unanswered.
        self.refused_prompts: dict[int, str] = {}
        self.refused_tickets = 0
        self._unreported_refusals: dict[str, str] = {}  # group id -> why, for the next work request
        # Groups written whole to a durable buffer and not yet reported (WorkRequest.written); in order.
        self._unreported_written: dict[str, None] = {}
        self._scorer = DaemonRunner("reward")
        self.patience_s = config.generator.learner_patience_s
        self.produced_log: IO[str] | None = None  # one line per rollout id written to the buffer
        # A restarted generator keeps its id; the learner tells the new process by this and gives
        # the old one's tickets out again at once instead of after generator_lease_s.
        self.incarnation = uuid.uuid4().hex[:12]
        self._asks = 0  # numbers each work request (its request_id); a retry of one keeps its number
        self.weight_session = ""  # WeightUpdate.session of the weights served ("": the model it started with)
        # Set by drain() (from a SIGTERM handler: a plain flag, read between batches).
        self.draining = False

    def drain(self) -> None:
        """Finish the batch in hand, then say goodbye to the learner and return from :meth:`run`.

        Work is asked for only between batches, so when :meth:`run` sees the
        flag every ticket it held has been generated and written: the learner
        has nothing to reissue. While draining, a learner that does not answer
        is given one ``coordinator.timeout_s``, not ``generator.learner_patience_s``.
        """
        self.draining = True

    def _request(self, max_groups: int, leaving: bool = False) -> WorkRequest:
        self._asks += 1
        return WorkRequest(
            generator_id=self.generator_id,
            weight_version=self.backend.version,
            weight_session=self.weight_session,
            refused=dict(self._unreported_refusals),
            written=list(self._unreported_written),
            max_groups=max_groups,
            samples_generated=self.samples_generated,
            busy_s=self.busy_s,
            reward_failures=dict(self.reward_failures),
            wait_s=self.config.coordinator.long_poll_s if max_groups else 0.0,
            incarnation=self.incarnation,
            leaving=leaving,
            request_id=f"{self.incarnation}-{self._asks}",
        )

    def _ask(self, max_groups: int) -> WorkReply:
        with trace.span("ask", groups=max_groups):
            request = self._request(max_groups)
            reply = wait_for_reply(self.client, request, WorkReply, 0.0 if self.draining else self.patience_s)
        for group_id in request.refused:  # heard: the learner retired those prompts
            self._unreported_refusals.pop(group_id, None)
        for group_id in request.written:  # heard: the learner waits for those groups should this process end
            self._unreported_written.pop(group_id, None)
        return reply

    def _leave(self) -> None:
        """A drained generator's goodbye: the learner forgets it now instead of after its lease."""
        try:
            self.client.call(self._request(0, leaving=True), WorkReply)
        except TimeoutError as exc:
            log.warning(
                "%s: drained; the learner did not answer its goodbye (%s), so it forgets this generator "
                "only after coordinator.generator_lease_s",
                self.generator_id,
                exc,
            )
            return
        log.info(
            "%s: drained: no tickets left in hand; generated %d samples", self.generator_id, self.samples_generated
        )

    def _maybe_update(self, latest: WeightUpdate | None) -> None:
        if latest is None or not self.receiver.wants(latest, (self.weight_session, self.backend.version)):
            return
        started = time.monotonic()
        if latest == self._failed_update and started < self._retry_update_at:
            return
        try:
            with trace.span("weight_load", version=latest.version):
                self.receiver.receive(latest, self.backend, self.config.generator.weight_load_timeout_s)
        except Exception as exc:  # the old version keeps serving; report, back off and go on
            if superseded(exc):  # shared weights: the learner wrote a newer version, announced next
                self.superseded_in_a_row += 1
                if self.superseded_in_a_row % SUPERSEDED_WARN_EVERY == 0:
                    log.warning(
                        "%s: %d versions in a row were overwritten before they could be copied; still on v%d: %s",
                        self.generator_id,
                        self.superseded_in_a_row,
                        self.backend.version,
                        exc,
                    )
                return
            self.failed_updates += 1
            self.failed_updates_total += 1
            log.error(
                "%s: loading weights v%d failed, still on v%d: %s",
                self.generator_id,
                latest.version,
                self.backend.version,
                exc,
            )
            self._failed_update = latest
            self._retry_update_at = time.monotonic() + min(0.1 * 2 ** min(self.failed_updates, 6), 5.0)
            return
        self.weight_session = latest.session
        self.failed_updates, self._retry_update_at = 0, 0.0
        self.superseded_in_a_row = 0
        self.last_load_s = time.monotonic() - started
        log.info("%s: loaded weights v%d in %.3fs", self.generator_id, self.backend.version, self.last_load_s)

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
                self.failed_updates_total,
                counter=True,
            ),
            Metric(
                "generator_refused_tickets",
                "tickets left unanswered because the engine refused their prompt",
                self.refused_tickets,
                counter=True,
            ),
        ]
        if self.last_load_s is not None:
            out.append(
                Metric("generator_weight_load_seconds", "seconds the latest weight update took", self.last_load_s)
            )
        return out

    def run(self) -> None:
        """Work until the learner says stop, or until drained (:meth:`drain`)."""
        groups = self.config.generator.groups_per_request
        while True:
            if self.draining:
                # Every rollout written leaves this process before the goodbye: the learner settles a
                # drained generator's tickets only as their groups arrive.
                self.writer.close(linger_s=self.config.buffer.timeout_s)
                self._leave()
                return
            reply = self._ask(groups)
            if reply.stop:  # before any weight load: a learner that is done may no longer serve its weights
                if reply.reason:
                    log.error("%s: told to stop: %s", self.generator_id, reply.reason)
                else:
                    log.info("%s: the learner is done; generated %d samples", self.generator_id, self.samples_generated)
                return
            self._maybe_update(reply.latest)
            if reply.eval is not None:
                self._evaluate(reply.eval)
            if not reply.tickets:
                # The learner hands out no work to a generator behind its latest version: wait for the retry.
                wait_s = max(reply.retry_after_s, self._retry_update_at - time.monotonic())
                if wait_s > 0:
                    with trace.span("idle"):
                        time.sleep(wait_s)
                continue
            index_of = {t.group_id: t.prompt_index for t in reply.tickets}
            requests = [
                GenerationRequest(t.group_id, self._prompt(t.prompt_index))
                for t in reply.tickets
                if not self._known_refused(t)
            ]
            started = time.monotonic()
            self._last_poll = started
            # Fakes in tests may leave updates_mid_batch out: they take updates where asked to.
            mid_batch = self.config.generator.update_in_flight and getattr(self.backend, "updates_mid_batch", True)
            poll = self._poll_for_update if mid_batch else self._heartbeat
            span_start = time.time_ns()
            for request, samples in self._generate(requests, index_of, poll):
                trace.complete("generate", span_start, time.time_ns())
                rollouts = self._rollouts(request, index_of[request.request_id], samples, time.monotonic() - started)
                self.samples_generated += len(rollouts)
                if not self._push(rollouts):
                    return
                span_start = time.time_ns()
            self.busy_s += time.monotonic() - started

    def _evaluate(self, ticket: EvalTicket) -> None:
        """Answer one piece of a held-out evaluation and report it; a failure is logged, the piece reissued later."""
        from generators.evaluate import answer_extractor, evaluate

        started = time.monotonic()
        self._last_poll = started
        try:
            with trace.span("evaluate", version=ticket.version, prompts=len(ticket.indices)):
                traces = evaluate(
                    self.backend,
                    ticket,
                    self.eval_items,
                    self._build_prompt,
                    self._reward_in_time,
                    answer_extractor(),
                    between_steps=self._heartbeat,
                    stop=self.params.stop,
                )
            wait_for_reply(
                self.client,
                EvalReport(
                    generator_id=self.generator_id, version=ticket.version, indices=ticket.indices, traces=traces
                ),
                Ack,
                self.patience_s,
            )
        except Exception as exc:  # noqa: BLE001  (evaluation must not stop generation)
            log.error(
                "%s: evaluation of v%d (%d prompts) failed: %s",
                self.generator_id,
                ticket.version,
                len(ticket.indices),
                exc,
            )
            return
        log.info(
            "%s: evaluated %d held-out prompts for v%d in %.1fs",
            self.generator_id,
            len(ticket.indices),
            ticket.version,
            time.monotonic() - started,
        )

    def _poll_for_update(self) -> None:
        """Between two engine steps: every ``update_poll_s``, ask for the newest version and take it.

        The rest of the batch continues on the new weights; token versions tell
        which tokens came from which. A pushed version only reaches the engine
        here, so this interval is also how long the learner may wait for it.
        """
        if time.monotonic() - self._last_poll < min(
            self.config.generator.update_poll_s, self.config.coordinator.generator_lease_s / 4
        ):
            return
        self._maybe_update(self._ask(0).latest)
        self._last_poll = time.monotonic()

    def _heartbeat(self) -> None:
        """Between two engine steps of a batch that takes no new weights (an evaluation, or
        ``update_in_flight: false``): ask for nothing four times per ``generator_lease_s``.

        Every request renews this generator's lease; without these, a batch
        longer than the lease would have its tickets taken back and its groups
        dropped as orphans when they arrive.
        """
        if time.monotonic() - self._last_poll < self.config.coordinator.generator_lease_s / 4:
            return
        self._last_poll = time.monotonic()
        try:
            self._ask(0)
        except (TimeoutError, RemoteError) as exc:  # best effort: the batch in hand goes on (a drain asks once)
            log.warning("%s: a heartbeat to the learner went unanswered: %s", self.generator_id, exc)

    def _build_prompt_of(self, index: int) -> list[int]:
        return self._build_prompt(self.items[index])

    def _generate(
        self, requests: list[GenerationRequest], index_of: dict[str, int], poll: Callable[[], None] | None
    ) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
        """The backend's groups for ``requests``; one the engine refuses (vLLM checks a prompt against its
        ``max_model_len`` as it is added, before any step) is refused alone instead of ending the process.

        Which request was refused is found by sending each alone, once: a refused prompt is remembered and
        never sent again, so only the batch that first meets it loses its batching.
        """
        if not requests:
            return
        stream = self.backend.generate(requests, self.params, poll)
        try:
            first = next(stream, None)
        except PromptRefused as exc:
            if len(requests) == 1:
                self._refuse(requests[0], index_of[requests[0].request_id], exc)
                return
            for request in requests:
                yield from self._generate([request], index_of, poll)
            return
        if first is not None:
            yield first
            yield from stream

    def _refuse(self, request: GenerationRequest, index: int, error: Exception) -> None:
        """Log a refused prompt once, with its index and dataset row; its ticket is reported to the learner."""
        self.refused_prompts[index] = f"{type(error).__name__}: {error}"
        self.refused_tickets += 1
        self._unreported_refusals[request.request_id] = self.refused_prompts[index]
        log.error(
            "%s: the engine refused prompt %d (row %s, %d tokens): %s; the learner is told, and issues it no "
            "more. Skip such rows with task.max_prompt_tokens (set by itself from "
            "generator.vllm.max_model_len)",
            self.generator_id,
            index,
            self.items[index].get("row", "-"),
            len(request.prompt_ids),
            self.refused_prompts[index],
        )

    def _known_refused(self, ticket: PromptTicket) -> bool:
        """A ticket for a prompt the engine refused before (issued before the learner heard): reported, not sent."""
        if ticket.prompt_index not in self.refused_prompts:
            return False
        self.refused_tickets += 1
        self._unreported_refusals[ticket.group_id] = self.refused_prompts[ticket.prompt_index]
        return True

    def _rollouts(self, request: GenerationRequest, index: int, samples: list[Sample], took_s: float) -> list[Rollout]:
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

    def _reward_in_time(self, text: str, item: dict[str, Any]) -> float:
        """``reward_fn`` in the scorer thread, within ``task.reward_timeout_s``: a reward that hangs must not
        hold the generator (held-out evaluation scores a failure as 0)."""
        [result] = self._within_timeout(lambda: [float(self.reward_fn(text, item))], 1)
        if isinstance(result, str):
            raise TimeoutError(result)
        return result

    def _within_timeout(self, call: Callable[[], list[float | str]], n: int) -> list[float | str]:
        """``call()`` in the scorer thread, or ``n`` timeouts after ``task.reward_timeout_s``.

        Scoring renews the lease as generating does: a batch's groups can all
        finish at one engine step and be scored back to back, and a slow
        reward (a judge model, a sandbox) could otherwise outlast
        ``generator_lease_s``, having its finished groups taken back.
        """
        timeout_s = self.config.task.reward_timeout_s
        self._heartbeat()  # at most four times per lease: between two quick scores it asks nothing
        try:
            return self._scorer.call(
                call, timeout_s, while_waiting=self._heartbeat, every_s=self.config.coordinator.generator_lease_s / 8
            )
        except Abandoned:
            self._scorer = DaemonRunner("reward")
            return [f"timeout: no score within task.reward_timeout_s={timeout_s:g}"] * n

    def _score(self, samples: list[Sample], item: dict[str, Any], ids: list[str]) -> list[float | None]:
        """Rewards of one group, scored in a helper thread within ``task.reward_timeout_s`` each (the whole
        group's, for a reward that scores a group in one call).

        A reward that raises, returns something that is not a finite number,
        or runs out of time is None: its rollout goes out marked
        ``reward_failed`` (reward 0), which the learner leaves out of the
        advantages. It is logged with the rollout id and counted per reason
        (``reward_failures``), and the generator goes on.
        A timed-out scorer thread is abandoned (Python cannot stop it) and a
        fresh one takes over.
        """

        def score_group() -> list[float | str]:  # one call for the group: a remote reward model batches it
            try:
                values = [as_reward(v) for v in self.reward_fn.score_group([s.text for s in samples], item)]
                if len(values) != len(samples):
                    raise ValueError(f"score_group returned {len(values)} scores for {len(samples)} samples")
            except Exception as exc:  # noqa: BLE001  (a user's reward must not stop generation)
                return [f"{type(exc).__name__}: {exc}"] * len(samples)
            return [v if math.isfinite(v) else "non_finite" for v in values]

        def score(sample: Sample) -> list[float | str]:
            try:
                value = as_reward(self.reward_fn(sample.text, item))
                return [value if math.isfinite(value) else "non_finite"]
            except Exception as exc:  # noqa: BLE001  (a user's reward must not stop generation)
                return [f"{type(exc).__name__}: {exc}"]

        with trace.span("reward"):
            if getattr(self.reward_fn, "score_group", None) is not None:
                results = self._within_timeout(score_group, len(samples))
            else:  # each sample within its own limit: one slow response fails alone
                results = [
                    result
                    for sample in samples
                    for result in self._within_timeout(lambda sample=sample: score(sample), 1)
                ]
        rewards: list[float | None] = []
        for rollout_id, result in zip(ids, results):
            if isinstance(result, float):
                rewards.append(result)
                continue
            reason = result.split(":", 1)[0]
            self.reward_failures[reason] += 1
            if self.reward_failures[reason] <= 10 or self.reward_failures[reason] % 1000 == 0:
                log.warning(
                    "%s: reward of %s failed (%s #%d): %s",
                    self.generator_id,
                    rollout_id,
                    reason,
                    self.reward_failures[reason],
                    result,
                )
            rewards.append(None)
        return rewards

    def _push(self, rollouts: list[Rollout]) -> bool:
        """Write to the buffer, waiting out a full buffer; False once the learner is done."""
        groups = dict.fromkeys(r.group_id for r in rollouts)  # a group is pushed in one call
        while True:
            try:
                with trace.span("buffer_put", rollouts=len(rollouts)):
                    self.writer.put(rollouts, self.config.buffer.timeout_s)
                self._log_produced(rollouts)
                if self.writer.durable:
                    self._unreported_written.update(groups)
                return True
            except BufferTimeout as exc:
                self._log_produced(rollouts[: exc.sent])
                rollouts = rollouts[exc.sent :]
                log.warning("%s: %s; checking on the learner", self.generator_id, exc)
                reply = self._ask(0)
                if reply.stop:
                    return False
                self._maybe_update(reply.latest)  # a pushed version waits for us to join it

    def _log_produced(self, rollouts: list[Rollout]) -> None:
        if self.produced_log is not None and rollouts:
            self.produced_log.write("".join(r.rollout_id + "\n" for r in rollouts))
            self.produced_log.flush()
