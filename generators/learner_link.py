"""A generator's conversation with the learner's coordinator: work requests, heartbeats, refusals and goodbye.

Every request doubles as a heartbeat that renews this generator's lease on
its tickets (``coordinator.generator_lease_s``), and carries what the
learner must hear: the version served, the prompts the engine refused, the
groups written to a durable buffer, the counts behind ``asyncrl status``.
A request that goes unanswered is sent again for up to
``generator.learner_patience_s`` (:func:`wait_for_reply`), under the same
request id, so that a reply lost on the way is sent again rather than
followed by new tickets.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from asyncrl.config import RunConfig
from asyncrl.control.client import CoordinatorClient, RemoteError, wait_for_reply
from asyncrl.control.watch import VersionWatch
from asyncrl.observe import trace
from asyncrl.wire.protocol import (
    Ack,
    EvalReport,
    EvalTicket,
    EvalTrace,
    PromptTicket,
    WeightUpdate,
    WorkReply,
    WorkRequest,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """What every work request reports about the generator, read as the request goes out."""

    weight_version: int = 0
    weight_session: str = ""  # WeightUpdate.session of the weights served ("": the model it started with)
    samples_generated: int = 0
    tokens_generated: int = 0
    busy_s: float = 0.0
    reward_failures: dict[str, int] = field(default_factory=dict)


def announced(update: WeightUpdate | None) -> tuple | None:
    """What tells one announcement from another: the version's identity, and a push's group."""
    return None if update is None else (*update.identity, update.epoch)


class LearnerLink:
    """This generator's side of the coordinator's protocol; ``progress()`` gives the counts each request reports.

    ``clock`` times the heartbeats and weight polls between two engine steps.
    ``draining`` is a plain flag (set from a SIGTERM handler): while it is
    set, a learner that does not answer is given one ``coordinator.timeout_s``,
    not ``generator.learner_patience_s``.
    """

    def __init__(
        self,
        config: RunConfig,
        generator_id: str,
        client: CoordinatorClient,
        progress: Callable[[], Progress] = Progress,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generator_id = generator_id
        self.client = client
        self.progress = progress
        self.patience_s = config.generator.learner_patience_s
        self.long_poll_s = config.coordinator.long_poll_s
        self.run_id = config.coordinator.run_id
        self.lease_s = config.coordinator.generator_lease_s
        self.update_poll_s = config.generator.update_poll_s
        self.draining = False
        # A restarted generator keeps its id; the learner tells the new process by this and gives
        # the old one's tickets out again at once instead of after generator_lease_s.
        self.incarnation = uuid.uuid4().hex[:12]
        self._asks = 0  # numbers each work request (its request_id); a retry of one keeps its number
        # Prompts the engine refused (index -> its reason), never sent to it again, and tickets left unanswered.
        self.refused_prompts: dict[int, str] = {}
        self.refused_tickets = 0
        self.unreported_refusals: dict[str, str] = {}  # group id -> why, for the next work request
        # Groups written whole to a durable buffer and not yet reported (WorkRequest.written); in order.
        self.unreported_written: dict[str, None] = {}
        self._clock = clock
        self._last_ask = clock()  # when this generator last asked the learner anything
        self._watch: VersionWatch | None = None  # made at the first poll
        self._watch_again_at = 0.0  # no watch before this: the learner had nothing newer than the last answer
        self._announced: tuple | None = None  # the latest version the learner named in its last answer
        # The learner said stop (with its reason: "" when it is done) in an answer between two engine steps;
        # the batch in hand ends at its next group and the generator stops (None: not told).
        self.stop_reason: str | None = None

    # ------------------------------------------------------------------ asking
    def request(self, max_groups: int, leaving: bool = False, wait: bool = True, watch: bool = False) -> WorkRequest:
        """The next work request: ``max_groups`` tickets wanted (0: a heartbeat); with ``wait``, the learner may
        hold it for up to ``coordinator.long_poll_s`` until it has work to give. A ``watch`` asks for nothing
        and is held until the learner has a version newer than this generator's; it reports no refusals or
        writes, which a request answered in turn settles (they are forgotten when its answer comes)."""
        self._asks += 1
        progress = self.progress()
        return WorkRequest(
            generator_id=self.generator_id,
            weight_version=progress.weight_version,
            weight_session=progress.weight_session,
            refused={} if watch else dict(self.unreported_refusals),
            written=[] if watch else list(self.unreported_written),
            max_groups=0 if watch else max_groups,
            samples_generated=progress.samples_generated,
            tokens_generated=progress.tokens_generated,
            busy_s=progress.busy_s,
            reward_failures=dict(progress.reward_failures),
            wait_s=self.long_poll_s if watch or (max_groups and wait) else 0.0,
            incarnation=self.incarnation,
            leaving=leaving,
            request_id=f"{self.incarnation}-{self._asks}",
            run_id=self.run_id,
        )

    def ask(self, max_groups: int, wait: bool = True) -> WorkReply:
        """Ask for up to ``max_groups`` tickets and the latest version; TimeoutError once patience runs out.

        ``wait``: let the learner hold the request until it has work (a long poll); a generator with requests
        in flight asks without, so that its engine never waits on the answer.
        """
        with trace.span("ask", groups=max_groups):
            request = self.request(max_groups, wait=wait)
            reply = wait_for_reply(self.client, request, WorkReply, 0.0 if self.draining else self.patience_s)
        for group_id in request.refused:  # heard: the learner retired those prompts
            self.unreported_refusals.pop(group_id, None)
        for group_id in request.written:  # heard: the learner waits for those groups should this process end
            self.unreported_written.pop(group_id, None)
        self._heard(reply)
        return reply

    def _heard(self, reply: WorkReply) -> None:
        """What every answer tells: the learner's latest version, and whether to stop."""
        if reply.stop:
            self.stop_reason = reply.reason
        self._announced = announced(reply.latest)

    def report_eval(self, ticket: EvalTicket, traces: list[EvalTrace], took_s: float) -> None:
        """Hand in one answered piece of a held-out evaluation; one the learner does not take is logged (it
        hands the piece out again later: an evaluation never stops a generator)."""
        report = EvalReport(
            generator_id=self.generator_id, version=ticket.version, indices=ticket.indices, traces=traces
        )
        try:
            wait_for_reply(self.client, report, Ack, self.patience_s)
        except Exception as exc:  # noqa: BLE001  (evaluation must not stop generation)
            self.eval_failed(ticket, exc)
            return
        log.info(
            "%s: evaluated %d held-out prompts for v%d in %.1fs",
            self.generator_id,
            len(ticket.indices),
            ticket.version,
            took_s,
        )

    def eval_failed(self, ticket: EvalTicket, error: Exception) -> None:
        """Log a piece of a held-out evaluation that could not be answered or handed in."""
        log.error(
            "%s: evaluation of v%d (%d prompts) failed: %s",
            self.generator_id,
            ticket.version,
            len(ticket.indices),
            error,
        )

    def leave(self) -> None:
        """A drained generator's goodbye: the learner forgets it now instead of after its lease."""
        try:
            self.client.call(self.request(0, leaving=True), WorkReply)
        except TimeoutError as exc:
            log.warning(
                "%s: drained; the learner did not answer its goodbye (%s), so it forgets this generator "
                "only after coordinator.generator_lease_s",
                self.generator_id,
                exc,
            )
            return
        log.info(
            "%s: drained: no tickets left in hand; generated %d samples",
            self.generator_id,
            self.progress().samples_generated,
        )

    # ------------------------------------------------------------------ between two engine steps
    def lease_renewed(self) -> None:
        """The learner just heard from this generator: the next heartbeat or weight poll is a full interval away."""
        self._last_ask = self._clock()

    def heartbeat(self) -> None:
        """Between two engine steps of a batch that takes no new weights (an evaluation, a slow reward, or
        ``update_in_flight: false``): ask for nothing four times per ``generator_lease_s``.

        Every request renews this generator's lease; without these, a batch
        longer than the lease would have its tickets taken back and its groups
        dropped as orphans when they arrive.
        """
        if self._clock() - self._last_ask < self.lease_s / 4:
            return
        self._last_ask = self._clock()
        try:
            self.ask(0)
        except (TimeoutError, RemoteError) as exc:  # best effort: the batch in hand goes on (a drain asks once)
            log.warning("%s: a heartbeat to the learner went unanswered: %s", self.generator_id, exc)

    def poll(self, take: Callable[[WeightUpdate | None], None]) -> None:
        """Between two engine steps: ``take`` the learner's version once it has announced a new one.

        The learner holds a request for the next version (a watch) and answers
        it when it publishes; this looks whether the answer came without
        waiting, so the engine waits on the learner only for the one request
        that then asks for the version to take. The rest of the batch
        continues on the new weights; token versions tell which tokens came
        from which. An answer that says stop sets :attr:`stop_reason` and
        nothing more is asked.

        A watch is answered at once while the generator holds an older version
        than the learner's latest: one it could not take yet (a load backing
        off after a failure, a push it missed). Such an answer names nothing
        new, so it is tried again without asking, and the next watch waits
        ``generator.update_poll_s``: the engine does not wait on the learner
        every other step for news it has.
        """
        if self.stop_reason is not None:
            return
        now = self._clock()
        if self._watch is None:
            self._watch = self.client.watch(lambda: self.request(0, watch=True), self.long_poll_s, self._clock)
        answer = self._watch.newest() if now >= self._watch_again_at else None
        if answer is not None and answer.stop:
            self._heard(answer)
            return
        news = answer is not None and announced(answer.latest) != self._announced
        if answer is not None and not news:
            self._watch_again_at = now + self.update_poll_s
            take(answer.latest)
        # What the learner must hear (groups written to a durable buffer, prompts the engine refused) goes in
        # a request answered in turn, every generator.update_poll_s at most.
        due = (self.unreported_written or self.unreported_refusals) and now - self._last_ask >= min(
            self.update_poll_s, self.lease_s / 4
        )
        if news or due:
            # The watch's answer may have waited in its socket while the engine stepped: the version to take
            # (a push's group, say) is the learner's now, asked for in turn.
            reply = self.ask(0)
            self._last_ask = self._clock()
            if not reply.stop:
                take(reply.latest)

    # ------------------------------------------------------------------ what the next request reports
    def refuse(self, group_id: str, index: int, error: Exception, row: object, prompt_tokens: int) -> None:
        """Log a prompt the engine refused, once, with its index and dataset row; its ticket is reported."""
        self.refused_prompts[index] = f"{type(error).__name__}: {error}"
        self.refused_tickets += 1
        self.unreported_refusals[group_id] = self.refused_prompts[index]
        log.error(
            "%s: the engine refused prompt %d (row %s, %d tokens): %s; the learner is told, and issues it no "
            "more. Skip such rows with task.max_prompt_tokens (set by itself from "
            "generator.vllm.max_model_len)",
            self.generator_id,
            index,
            row,
            prompt_tokens,
            self.refused_prompts[index],
        )

    def known_refused(self, ticket: PromptTicket) -> bool:
        """A ticket for a prompt the engine refused before (issued before the learner heard): reported, not sent."""
        if ticket.prompt_index not in self.refused_prompts:
            return False
        self.refused_tickets += 1
        self.unreported_refusals[ticket.group_id] = self.refused_prompts[ticket.prompt_index]
        return True

    def written(self, group_ids: Iterable[str]) -> None:
        """Groups written whole to a durable buffer: the learner waits for them should this generator be lost."""
        self.unreported_written.update(dict.fromkeys(group_ids))
