"""Complete, fresh rollout groups out of the buffer's stream, with every drop accounted for."""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable

from asyncrl.control.coordinator import Coordinator, OutstandingTicket
from asyncrl.observe import trace
from asyncrl.wire.protocol import Rollout
from buffers import RolloutReader
from learners.rollout_sample import DropSample

log = logging.getLogger(__name__)


class RecentIds:
    """The ids of the last ``limit`` rollouts trained on, for the ``duplicate`` label.

    Only a label: a consumed group's ticket is closed, so a member delivered
    again is dropped as an orphan all the same. Bounded, because a service
    that trains for days consumes millions of rollouts (and a checkpoint
    writes this set).
    """

    def __init__(self, ids: Iterable[str] = (), limit: int = 1 << 16) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()
        self.update(ids)

    def update(self, ids: Iterable[str]) -> None:
        for rollout_id in ids:
            self._ids[rollout_id] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def add(self, rollout_id: str) -> None:
        self.update((rollout_id,))

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self):
        return iter(self._ids)


class GroupBatcher:
    """Turns the rollout stream into batches of complete, fresh groups.

    A group is complete once all ``group_size`` of its samples arrived. The
    staleness check runs when a group is taken into a batch, at the version
    of the step that will consume it, which is the moment the bound is about.

    Every rollout received and not trained on is dropped with a reason,
    counted in ``drops`` and listed in ``dropped`` (for ``dropped.jsonl``):
    ``stale`` and ``future_version`` (the bound's verdict), ``duplicate``
    (already trained on, redelivered by a durable buffer), ``orphaned`` (its
    ticket was released), a rejection reason from the reader
    (``non_finite_logprobs``, ``token_out_of_range``...) and
    ``rejected_group`` (a member of its group was rejected), and
    ``uniform_reward`` (dynamic sampling: every reward of the group equal),
    ``reward_failed`` (dynamic sampling: fewer than two rewards scored) and
    ``wrong_group_size`` (its generator samples groups of another size), and
    ``env_error`` (a multi-turn episode whose environment raised or timed out).
    A rejected
    member abandons its group's ticket at once, so the prompt is issued
    again right away instead of after ``ticket_timeout_s``.

    Runs on the learner's main thread only; other threads read
    :attr:`oldest_waiting_version`, a plain value replaced after every read.
    """

    def __init__(
        self,
        reader: RolloutReader,
        coordinator: Coordinator,
        timeout_s: float,
        should_stop: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], bool] = lambda: False,
        skip_uniform: bool = False,
        length_edges: tuple[int, ...] = (),
        dropped_sample: DropSample | None = None,
        max_skip_rounds: int = 0,
    ) -> None:
        self.reader = reader
        # DAPO's dynamic sampling: a group whose rewards are all equal has no advantage to learn
        # from; it is dropped (``uniform_reward``) and the batch takes the next group instead.
        self.skip_uniform = skip_uniform
        self.max_skip_rounds = max_skip_rounds  # a step that drops this many batches' worth fails (0: never)
        # Response-length buckets (upper edges) for the stale-drop rate by length.
        self.length_edges = length_edges
        self.by_length: dict[int, Counter[str]] = defaultdict(Counter)  # by bucket index
        # Called about once a second while no complete group is waiting; True means weights are
        # still on their way to generators, and the wait does not count against the timeout.
        self.on_wait = on_wait
        self.bound = coordinator.bound
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.should_stop = should_stop
        self.consumed_ids = RecentIds()
        self._pending: dict[str, dict[str, Rollout]] = defaultdict(dict)
        self._wrong_size_from: set[str] = set()  # generators already reported for it
        self._complete: list[list[Rollout]] = []
        self.dropped: list[tuple[str, str]] = []  # (rollout id, reason) since the last ack
        self.drops: Counter[str] = Counter()  # every drop of the run, by reason
        # A few of the rollouts dropped, whole, for the run's kept sample (learners.rollout_sample)
        self.dropped_sample = dropped_sample if dropped_sample is not None else DropSample(0)
        # Where the learner's wait for a batch went, since the last step (reset by the trainer):
        self.buffer_s = 0.0  # the buffer's own work (receive, decode)
        self.wait_rollouts_s = 0.0  # blocked on an empty buffer: generation is behind
        self.housekeeping_s = 0.0  # status, evaluation results and weight re-pushes while waiting
        self.oldest_waiting_version: int | None = None
        self.waiting = 0  # rollouts received and not yet trained on
        # Members of the last batch's groups dropped as stale: not trained on, but their rewards are as
        # valid a draw as any, and still count in their group's statistics (``algo.step_advantages``).
        self.stale_peers: list[Rollout] = []

    def next_batch(self, num_groups: int, learner_version: int) -> list[Rollout] | None:
        """``num_groups`` groups with at least one fresh sample each, flattened.

        Returns ``None`` if ``should_stop()`` turns true while waiting (the
        groups taken so far go back, uncounted); raises ``TimeoutError`` when
        no rollout arrives for ``timeout_s``.
        """
        taken: list[list[Rollout]] = []
        peers: list[Rollout] = []
        skipped: Counter[str] = Counter()  # groups dynamic sampling dropped for this batch, by reason
        deadline = time.monotonic() + self.timeout_s
        housekeeping_at = 0.0
        while len(taken) < num_groups:
            if self.should_stop():
                self._complete[:0] = taken
                return None
            if not self._complete:
                try:
                    if self._read(deadline):
                        deadline = time.monotonic() + self.timeout_s
                    elif time.monotonic() >= housekeeping_at:
                        housekeeping_at = time.monotonic() + 1.0
                        started = time.perf_counter()
                        with trace.span("housekeeping"):
                            lagging = self.on_wait()
                        self.housekeeping_s += time.perf_counter() - started
                        if lagging:
                            deadline = time.monotonic() + self.timeout_s
                except TimeoutError:
                    self._complete[:0] = taken  # still received and not trained on: counted at stop
                    raise
                continue
            group = self._complete.pop(0)
            fresh, stale = [], []
            for rollout in self._episodes_dropped(group):
                reason = self.bound.verdict(rollout.oldest_version, learner_version)
                self.by_length[bisect.bisect_left(self.length_edges, len(rollout.response_ids))][reason or "fresh"] += 1
                if self.bound.keeps(reason):
                    fresh.append(rollout)
                else:
                    self.bound.release(1, reason)  # a drop is final at once
                    self._drop([rollout], reason)
                    stale.append(rollout)
            scored = [r.reward for r in group if not r.reward_failed]  # the whole group's, stale members too
            if fresh and self.skip_uniform and len(set(scored)) <= 1:
                # Fewer than two scored rewards because a reward failed (a server down, say) is not a solved prompt.
                reason = "reward_failed" if len(scored) < 2 and len(scored) < len(group) else "uniform_reward"
                self.bound.release(len(fresh), reason)
                self._drop(fresh, reason)
                skipped[reason] += 1
                if self.max_skip_rounds and sum(skipped.values()) >= self.max_skip_rounds * num_groups:
                    raise RuntimeError(
                        f"dynamic sampling dropped {sum(skipped.values())} groups ({dict(skipped)}) while filling "
                        f"one batch of {num_groups}: the reward is the same for every sample (or fails); check "
                        "the task's reward, or raise algo.dynamic_sampling_max_rounds"
                    )
            elif fresh:
                taken.append(fresh)
                peers.extend(stale)
        batch = [r for group in taken for r in group]
        self.stale_peers = peers
        for rollout in batch:  # consumed only now that the batch is whole
            self.bound.accept(rollout.oldest_version, learner_version)
        self._note_oldest()
        return batch

    def _episodes_dropped(self, group: list[Rollout]) -> list[Rollout]:
        """The members of ``group`` that can be trained on; an episode whose environment failed is dropped with
        its reason (``env_error``), and its group goes on without it."""
        for rollout in group:
            if rollout.dropped:
                log.warning("episode %s dropped: %s", rollout.rollout_id, rollout.dropped)
                self.bound.release(1, "env_error")
                self._drop([rollout], "env_error")
        return [r for r in group if not r.dropped]

    def staleness_by_length(self) -> dict[str, dict[str, float]]:
        """Per response-length bucket: samples that were fresh, stale or from the future, and the stale rate.

        With ``on_exceed: correct`` the stale ones were trained on (corrected); otherwise they were dropped.
        """
        edges = self.length_edges
        out = {}
        for index, counts in sorted(self.by_length.items()):
            low = edges[index - 1] if index else 0
            label = f"{low + 1}-{edges[index]}" if index < len(edges) else f">{low}"
            total = sum(counts.values())
            out[label] = {**dict(counts), "stale_rate": counts["stale"] / total if total else 0.0}
        return out

    def held_tickets(self) -> list[OutstandingTicket]:
        """Tickets of groups received but not yet trained on, for a checkpoint.

        Their rollouts live only in this process: a resumed learner treats the
        tickets as still out (reissued, or redelivered by a durable buffer).
        """
        groups = [list(g.values()) for g in self._pending.values()] + self._complete
        return [OutstandingTicket(g[0].prompt_index, g[0].group_id, g[0].generator_id) for g in groups if g]

    def left_over(
        self, settle_s: float = 0.5, limit_s: float = 10.0, generators_done: Callable[[], bool] = lambda: True
    ) -> int:
        """At stop: rollouts received and never trained on, plus what generators still deliver.

        Called once the coordinator hands out no more work: reads until every
        generator has been told to stop (``generators_done``) and nothing has
        arrived for ``settle_s``, or ``limit_s`` passes. Nothing read here is
        acknowledged: a durable buffer redelivers it to a resumed learner.
        """
        held = sum(len(g) for g in self._pending.values()) + sum(len(g) for g in self._complete)
        started = quiet_since = time.monotonic()
        while time.monotonic() - started < limit_s:
            got = self.reader.get(max_items=4096, timeout_s=0.1)
            now = time.monotonic()
            if got:
                held += len(got)
                quiet_since = now
            elif now - quiet_since >= settle_s and generators_done():
                break
        return held

    def _drop(self, rollouts: Iterable[Rollout], reason: str) -> None:
        rollouts = list(rollouts)
        for rollout in rollouts:
            self.dropped_sample.add(rollout, reason)
        self._drop_ids([r.rollout_id for r in rollouts], reason)

    def _drop_ids(self, rollout_ids: list[str], reason: str) -> None:
        """Drops known by id only (a message rejected on arrival); :meth:`_drop` for rollouts at hand."""
        if rollout_ids:
            self.dropped.extend((i, reason) for i in rollout_ids)
            self.drops[reason] += len(rollout_ids)

    def _read(self, deadline: float) -> bool:
        """One read from the buffer; True if a rollout joined its group (what a batch waits for: rollouts that
        are dropped or rejected on arrival are no progress, and must not hold the timeout off)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            dropped = f"; rollouts dropped so far, by reason: {dict(self.drops)}" if self.drops else ""
            raise TimeoutError(
                f"no complete rollout group for {self.timeout_s:.0f}s (learner.batch_timeout_s): "
                f"are the generators running and pointed at this buffer?{dropped}"
            )
        busy = self.reader.busy_s
        started_ns = time.time_ns()
        got = self.reader.get(max_items=4096, timeout_s=min(1.0, remaining))
        took_s = (time.time_ns() - started_ns) / 1e9
        # Backends that separate their own work from waiting report busy_s; for the
        # others, a read that found data counts as work, one that found none as waiting.
        busy_after = self.reader.busy_s
        work_s = busy_after - busy if busy is not None and busy_after is not None else (took_s if got else 0.0)
        self.buffer_s += work_s
        self.wait_rollouts_s += took_s - work_s
        trace.complete("buffer_read" if got else "wait_rollouts", started_ns, time.time_ns(), rollouts=len(got))
        joined = 0
        for rollout in got:
            if rollout.rollout_id in self.consumed_ids:
                self._drop([rollout], "duplicate")
                continue
            if rollout.group_id not in self._pending and not self.coordinator.is_outstanding(rollout.group_id):
                self._drop([rollout], "orphaned")  # its ticket was released: it can never complete
                continue
            if rollout.group_size != self.coordinator.group_size:  # the batch and every group baseline would change
                self._wrong_group_size(rollout)
                continue
            # Keyed by rollout id: a group reissued after a resume may arrive twice.
            members = self._pending[rollout.group_id]
            joined += rollout.rollout_id not in members
            members[rollout.rollout_id] = rollout
            if len(members) == rollout.group_size:
                del self._pending[rollout.group_id]
                if self.coordinator.complete(rollout.group_id):
                    self._complete.append(list(members.values()))
                else:
                    self._drop(members.values(), "orphaned")
        # After the good ones, so that members read together with a rejected one go with its group.
        rejected = self.reader.rejections.drain()
        for error in rejected:
            if error.group_id:  # its group is known, and can be let go now
                self._drop_ids([error.rollout_id], error.reason)
                self._abandon(error.group_id)
        # A partial group whose ticket was released (its generator died mid-group)
        # will never complete: drop it rather than hold its entries forever.
        for group_id in [g for g in self._pending if not self.coordinator.is_outstanding(g)]:
            self._drop(self._pending.pop(group_id).values(), "orphaned")
        self._note_oldest()
        return joined > 0

    def _wrong_group_size(self, rollout: Rollout) -> None:
        """A generator sampling other group sizes than the learner trains on: its groups are refused."""
        if rollout.generator_id not in self._wrong_size_from:
            self._wrong_size_from.add(rollout.generator_id)
            log.error(
                "generator %s sends groups of %d samples, this learner trains on groups of %d: its groups "
                "are dropped (wrong_group_size) and their prompts issued again; give it the learner's "
                "generator.samples_per_prompt",
                rollout.generator_id,
                rollout.group_size,
                self.coordinator.group_size,
            )
        self._drop([rollout], "wrong_group_size")
        self._abandon(rollout.group_id)

    def _abandon(self, group_id: str) -> None:
        """Drop what arrived of a group with a rejected member, and give its ticket back at once."""
        members = self._pending.pop(group_id, {})
        self._drop(members.values(), "rejected_group")
        self.coordinator.abandon(group_id, "rejected")

    def _note_oldest(self) -> None:
        versions = [r.oldest_version for g in self._pending.values() for r in g.values()]
        versions += [r.oldest_version for g in self._complete for r in g]
        self.oldest_waiting_version = min(versions, default=None)  # one assignment: safe to read anywhere
        self.waiting = len(versions)
