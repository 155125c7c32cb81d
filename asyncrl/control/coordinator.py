"""The learner's ticket ledger: prompt tickets, weight versions, and which generators are alive.

Generators ask the learner for work (:class:`~asyncrl.wire.protocol.WorkRequest`);
the reply carries prompt tickets and the latest published weights. Putting
the prompt cursor next to the staleness bound gives three properties at once:

* **No duplicates across a pool**: one cursor hands out every prompt once per
  epoch, whatever the number of generators.
* **Backpressure that keeps the staleness bound**: tickets are granted by
  :class:`~asyncrl.control.staleness.StalenessBound.admit` with the learner's own
  counts, so nothing is generated only to be thrown away in steady state.
* **Liveness**: every request is a heartbeat. A generator silent for longer
  than ``generator_lease_s`` is presumed dead; its tickets go back into the
  queue and their admission slots are released. Groups it reported written
  to a durable buffer (``WorkRequest.written``) are not generated again:
  they are in the buffer, and only ``ticket_timeout_s`` takes them back.

Leases and ticket ages follow the ``clock`` given (``time.monotonic``, or a test's fake), so a clock set
back cannot keep a dead generator alive; the time of day appears only in ``asyncrl status``'s
``last_seen_s``. The socket side is :mod:`asyncrl.control.server` and :mod:`asyncrl.control.client`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec

from asyncrl.control.evaluation import EvalBook
from asyncrl.control.roster import Roster
from asyncrl.control.staleness import StalenessBound
from asyncrl.control.tickets import CoordinatorState, OutstandingTicket, PromptCursor
from asyncrl.wire.protocol import GeneratorStatus, PromptTicket, WeightUpdate, WorkReply, WorkRequest

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "CoordinatorState", "OutstandingTicket", "PromptCursor"]


class Coordinator:
    """Ticket and version bookkeeping; pure, so it is tested without sockets.

    Every admitted slot ends exactly once as consumed, dropped (stale) or
    released (its generator went silent, or the ticket outlived
    ``ticket_timeout_s``); a released ticket's prompt is issued again under a
    new group id, and a group that arrives for a released ticket is an orphan.
    """

    def __init__(
        self,
        bound: StalenessBound,
        cursor: PromptCursor,
        group_size: int,
        lease_s: float,
        session: str = "s0",
        next_group: int = 0,
        ticket_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound = bound
        self.cursor = cursor
        self.group_size = group_size
        self.ticket_timeout_s = ticket_timeout_s
        self.clock = clock  # seconds, never set back: leases, ticket ages, and the server's long polls
        # Group ids carry the learner's session: groups in flight from before a learner restart never collide.
        self.session = session
        self.next_group = next_group
        self.latest: WeightUpdate | None = None
        self.retired: set[int] = set()  # prompt indices no engine can take (WorkRequest.refused)
        self.stopping = False
        self.roster = Roster(lease_s)
        self.generators = self.roster.status  # generator id -> what its last request reported
        # Generator id -> (request_id, reply) of its last reply that carried tickets or an evaluation piece.
        self._last_reply: dict[str, tuple[str, WorkReply]] = {}
        self._outstanding: dict[str, tuple[OutstandingTicket, float]] = {}  # group id -> (ticket, clock() at issue)
        # Tickets out whose group its generator wrote whole to a durable buffer: the loss of that generator
        # does not take them back (the group arrives from the buffer), only ticket_timeout_s does.
        self._written: set[str] = set()
        # Prompts to hand out again first, with the group id to reuse (after a resume) or None (after a loss).
        self._requeued: deque[tuple[int, str | None]] = deque()
        # Held while tickets are admitted or taken back, and for a checkpoint's snapshot (which calls state())
        self.lock = threading.RLock()
        self._expired_s = float("-inf")  # clock() when _expire last scanned
        self.evals: EvalBook | None = None  # held-out evaluation pieces, handed out with the work
        # Called after a change that may answer a held request (a new version, stop); set by the server.
        self.on_change: Callable[[], None] = lambda: None

    @property
    def lease_s(self) -> float:
        """``generator_lease_s``: how long a generator may stay silent before its tickets are taken back."""
        return self.roster.lease_s

    def handle_work(self, request: WorkRequest, final: bool = True) -> WorkReply | None:
        """Tickets for ``request`` (and the latest version, an evaluation piece, or stop).

        Unless ``final``, ``None`` when there is nothing to give yet: the
        server holds the request (a long poll) and asks again on a change.
        """
        with self.lock:
            if request.leaving:
                return self._goodbye(request)
            if self.roster.has_left(request):  # held from before its goodbye: not heard again
                return WorkReply(tickets=[], latest=self.latest, stop=True)
            refusal = self._register(request)
            if refusal is not None:
                return refusal
            self._note_written(request)
            self._expire()
            self._retire(request)
            if self.stopping:
                self.roster.told_to_stop.add(request.generator_id)
                return WorkReply(tickets=[], latest=self.latest, stop=True)
            again = self._answered_before(request)
            if again is not None:
                return again
            # A generator on other weights than the latest loads them before it gets work (older ones
            # normally; after the learner resumed from a checkpoint, any it loaded from before the restart).
            if self.latest is not None and (request.weight_session, request.weight_version) != self.latest.identity:
                return WorkReply(tickets=[], latest=self.latest, retry_after_s=0.0)
            issuable = len(self.retired) < self.cursor.num_prompts
            granted = self.bound.admit(request.weight_version, request.max_groups if issuable else 0, self.group_size)
            tickets = [self._issue(request.generator_id) for _ in range(granted)]
            piece = self.evals.next_piece(request.weight_version) if self.evals and request.max_groups else None
            if not tickets and piece is None and not final:
                return None
            # A caller that waited its time out asks again at once; one that could not wait sleeps a little.
            idle_s = 0.0 if tickets or piece or request.wait_s > 0 else 0.05
            reply = WorkReply(tickets=tickets, latest=self.latest, retry_after_s=idle_s, eval=piece)
            if request.request_id and (tickets or piece is not None):
                self._last_reply[request.generator_id] = (request.request_id, reply)
            return reply

    def _goodbye(self, request: WorkRequest) -> WorkReply:
        """A draining generator's last request (caller holds the lock): its counts kept, itself forgotten, its tickets
        left out (it wrote every group it was given: those still in the buffer settle them; refused ones here)."""
        self._retire(request)
        self._note_written(request)
        self.roster.count(request)  # what it generated since its last request
        self.roster.leaving(request)
        if self.evals:
            self.evals.generated(*self.roster.since_heard)
        self._forget(request.generator_id)
        log.info("generator %s left (drained)", request.generator_id)
        return WorkReply(tickets=[], latest=self.latest, stop=True)

    def _register(self, request: WorkRequest) -> WorkReply | None:
        """Renew the lease of ``request``'s generator (caller holds the lock); a stop reply if its id was taken over.

        A request from a new process under a known id takes back what the old
        process held; one from the old process after that is told to stop.
        """
        if self.roster.replaced(request):
            log.error(
                "generator %s: a process of an earlier start (incarnation %s) still asks for work while "
                "a later one runs under this id; it is told to stop (give each generator its own "
                "--generator-id)",
                request.generator_id,
                request.incarnation,
            )
            return WorkReply(
                tickets=[],
                latest=self.latest,
                stop=True,
                reason=f"another process now runs as generator {request.generator_id}",
            )
        if self.roster.heard(request, self.clock()):
            self._release_tickets_of(request.generator_id, "generator_restarted")
            self._last_reply.pop(request.generator_id, None)
        if self.evals:
            self.evals.generated(*self.roster.since_heard)
        return None

    def _forget(self, generator_id: str) -> None:
        """Drop what is known of a generator that left or went silent (caller holds the lock)."""
        self.roster.forget(generator_id)
        self._last_reply.pop(generator_id, None)

    def _answered_before(self, request: WorkRequest) -> WorkReply | None:
        """The reply already given to ``request`` if it is one sent again (caller holds the lock), else None.

        A generator sends a request again when its reply did not come in time
        (the learner was slow, or the connection was made afresh): if that
        reply carried tickets, they are out under this generator, and only
        this reply can bring them to it. Should any of them have been taken
        back meanwhile (its lease ran out), the rest are taken back too and
        the request is answered as a new one.
        """
        last = self._last_reply.get(request.generator_id)
        if not request.request_id or last is None or last[0] != request.request_id:
            return None
        reply = last[1]
        held = [
            t.group_id
            for t in reply.tickets
            if t.group_id in self._outstanding and self._outstanding[t.group_id][0].generator_id == request.generator_id
        ]
        if len(held) == len(reply.tickets):
            log.info(
                "generator %s asked again (request %s): its %d tickets are sent again",
                request.generator_id,
                request.request_id,
                len(held),
            )
            return msgspec.structs.replace(reply, latest=self.latest)
        for group_id in held:
            self._reissue(group_id, "reply_lost")
        del self._last_reply[request.generator_id]
        return None

    def _issue(self, generator_id: str) -> PromptTicket:
        index, group_id = self._requeued.popleft() if self._requeued else (self.cursor.next(), None)
        while index in self.retired:  # handle_work issues nothing once every prompt is retired
            index, group_id = self._requeued.popleft() if self._requeued else (self.cursor.next(), None)
        if group_id is None:
            group_id = f"{self.session}-g{self.next_group}"
            self.next_group += 1
        self._outstanding[group_id] = (OutstandingTicket(index, group_id, generator_id), self.clock())
        return PromptTicket(prompt_index=index, group_id=group_id)

    def _expire(self) -> None:
        """Take back the tickets of silent generators and overdue tickets (caller holds the lock).

        At most every quarter lease (and every second): held long polls are
        asked again every few milliseconds, and a scan of every outstanding
        ticket per ask would cost the learner's process a core at a few
        hundred generators.
        """
        now = self.clock()
        if now - self._expired_s < min(1.0, self.lease_s / 4):
            return
        self._expired_s = now
        dead = self.roster.silent(now)
        for generator_id in dead:
            log.warning("generator %s silent for %.0fs: its tickets are reissued", generator_id, self.lease_s)
            self._forget(generator_id)
        for group_id, (ticket, issued_s) in list(self._outstanding.items()):
            if ticket.generator_id in dead and group_id not in self._written:
                reason = "generator_lost"
            elif issued_s < now - self.ticket_timeout_s:
                reason = "ticket_timeout"
            else:
                continue
            self._reissue(group_id, reason)

    def _retire(self, request: WorkRequest) -> None:
        """The tickets ``request``'s generator will never answer, its engine having refused their prompt (caller
        holds the lock): their slots are freed and the prompt is not issued again, to any generator."""
        for group_id, why in request.refused.items():
            ticket, _ = self._outstanding.get(group_id, (None, 0.0))
            if ticket is None or ticket.generator_id != request.generator_id:
                continue  # released already (a request sent again), or not its ticket
            del self._outstanding[group_id]
            self.bound.release(self.group_size, "prompt_refused")
            if ticket.prompt_index not in self.retired:
                self.retired.add(ticket.prompt_index)
                log.warning(
                    "prompt %d is no longer issued: generator %s's engine refused it (%s)",
                    ticket.prompt_index,
                    request.generator_id,
                    why,
                )
            if len(self.retired) == self.cursor.num_prompts:
                log.error("every prompt was refused by the generators' engines: no work is left to issue")

    def _note_written(self, request: WorkRequest) -> None:
        """Mark the tickets ``request``'s generator reports written to a durable buffer (caller holds the lock)."""
        for group_id in request.written:
            ticket, _ = self._outstanding.get(group_id, (None, 0.0))
            if ticket is not None and ticket.generator_id == request.generator_id:
                self._written.add(group_id)

    def _reissue(self, group_id: str, reason: str) -> None:
        """Take an outstanding ticket back (caller holds the lock): its prompt goes out again, its slots free."""
        ticket, _ = self._outstanding.pop(group_id)
        self._written.discard(group_id)
        self._requeued.append((ticket.prompt_index, None))
        self.bound.release(self.group_size, reason)

    def _release_tickets_of(self, generator_id: str, reason: str) -> None:
        """A generator came back as a new process: what its old process held will never arrive."""
        mine = [g for g, (ticket, _) in self._outstanding.items() if ticket.generator_id == generator_id]
        lost = [g for g in mine if g not in self._written]
        for group_id in lost:
            self._reissue(group_id, reason)
        if lost:
            log.warning("generator %s restarted: its %d tickets are issued again", generator_id, len(lost))
        if len(mine) > len(lost):
            log.info(
                "generator %s restarted: %d of its groups are in the buffer already",
                generator_id,
                len(mine) - len(lost),
            )
        elif not mine:
            log.info("generator %s restarted: it held no tickets", generator_id)

    def abandon(self, group_id: str, reason: str) -> bool:
        """Give a ticket back now (a member of its group was rejected); its prompt is issued again.

        False if the ticket was not out (already released, or never issued).
        """
        with self.lock:
            if group_id not in self._outstanding:
                return False
            self._reissue(group_id, reason)
        self.on_change()  # its slots can be admitted again
        return True

    def samples_generated(self) -> int:
        """Samples every generator process reported generating, in all (those that left included)."""
        return self.roster.samples_generated  # one int, read whole from any thread

    def generator_list(self) -> list[GeneratorStatus]:
        """A copy of what is known about each generator, safe to use on any thread."""
        with self.lock:
            return list(self.generators.values())

    def complete(self, group_id: str) -> bool:
        """Close a ticket when its group arrives; False for a group nobody is waiting on."""
        with self.lock:
            self._written.discard(group_id)
            return self._outstanding.pop(group_id, None) is not None

    def state(self) -> CoordinatorState:
        """A snapshot for the learner's checkpoint."""
        with self.lock:
            return CoordinatorState(
                session=self.session,
                next_group=self.next_group,
                epoch=self.cursor.epoch,
                position=self.cursor.position,
                outstanding=[t for t, _ in self._outstanding.values()],
                requeued=list(self._requeued),
                retired=sorted(self.retired),
                written=sorted(self._written),
                incarnations=self.roster.incarnations(),
            )

    def restore(self, state: CoordinatorState, reissue: bool) -> None:
        """Continue from a checkpoint: same cursor, same tickets out.

        Tickets that were out keep their group ids; new ones get this
        session's ids, numbered on from the checkpoint, so a group issued by
        the previous learner after its last checkpoint can never be taken for
        a new one (it arrives as an orphan and is dropped). With ``reissue`` (a buffer
        that loses what is in flight when the learner dies) they are handed
        out again at once; a group that still arrives from before the crash
        merges with its reissue, since the learner deduplicates by rollout
        id. Without it (a durable buffer that still holds the rollouts) they
        stay out, their owners get a fresh lease, and only what never
        arrives is reissued when the lease or ``ticket_timeout_s`` runs out
        (the groups reported written, only at ``ticket_timeout_s``).
        """
        with self.lock:
            self.next_group = state.next_group
            self.cursor = PromptCursor(self.cursor.num_prompts, self.cursor.seed, state.epoch, state.position)
            self._requeued = deque(tuple(item) for item in state.requeued)
            self.retired = set(state.retired)
            if reissue:
                self._outstanding, self._written = {}, set()
                self._requeued.extendleft(reversed([(t.prompt_index, t.group_id) for t in state.outstanding]))
                self.bound.release(self.group_size * len(state.outstanding), "reissued_on_resume")
                return
            now = self.clock()
            self._outstanding = {t.group_id: (t, now) for t in state.outstanding}
            self._written = set(state.written) & set(self._outstanding)
            for t in state.outstanding:  # another process than the one that held them is a restart: taken back
                self.roster.expect(t.generator_id, now, state.incarnations.get(t.generator_id, ""))

    def stop(self) -> None:
        """From now on every request is answered with ``stop``."""
        with self.lock:
            self.stopping = True
        self.on_change()

    def generators_not_stopped(self) -> set[str]:
        """Live generators that have not yet been told to stop."""
        with self.lock:
            return set(self.generators) - self.roster.told_to_stop

    def is_outstanding(self, group_id: str) -> bool:
        """Whether ``group_id``'s ticket is still out (issued; not completed, abandoned, refused or taken back)."""
        with self.lock:
            return group_id in self._outstanding

    def lagging(self) -> list[str]:
        """Live generators that report other weights than the latest announced (a push they missed)."""
        with self.lock:
            if self.latest is None:
                return []
            return self.roster.lagging(self.latest.identity, self.clock())

    def publish(self, update: WeightUpdate) -> None:
        """Make ``update`` the latest weights, stamped with this learner's session; held requests get it at once."""
        with self.lock:
            self.latest = msgspec.structs.replace(update, session=self.session)
        self.on_change()
