"""The Redis Streams buffer's reading end: the learner's consumer group, its reads, acknowledgements and claims."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import ResponseError

from asyncrl.config import BufferConfig
from asyncrl.wire.protocol import ProtocolError, Rollout, RolloutLimits, decode_rollout
from buffers.base import Rejections
from buffers.redis_buffer import FIELD, _entries
from buffers.redis_connection import OutageWait, RedisOutage, StillDown, connect, redact, single_try

log = logging.getLogger(__name__)


class RedisReader:
    """The learner's side: one consumer of the group; entries stay pending until acked.

    ``get`` is called from the learner's main thread; ``stats`` may be called
    from another thread (each command takes its own pooled connection).
    ``clock`` and ``sleep`` time deadlines, reclaim scans and outages; a blocking read
    waits in Redis's real time, so on a fake clock a read that may find nothing uses ``timeout_s=0``.
    """

    busy_s = None  # waiting and reading are one blocking XREADGROUP: not told apart

    def __init__(
        self,
        config: BufferConfig,
        limits: RolloutLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._config = config
        self._clock = clock
        self.limits = limits or RolloutLimits(max_bytes=config.max_message_bytes)
        self._client = connect(config)
        # stats asks once, without redis-py's retries: a Redis that hangs holds it one socket timeout, not the
        # whole retry schedule.
        self._status_client = single_try(config)
        # Reads of new entries ask once too: redis-py's retry of an XREADGROUP whose reply was lost asks for
        # newer entries still, and those the first one moved to this consumer's pending list would wait there
        # for the reclaim scan (buffer.claim_idle_s). Failing instead, the reader reads its pending list next.
        self._new_client = single_try(config)
        self.consumer = config.consumer
        # A BLOCK longer than the socket timeout would look like a dead server.
        self._block_cap_s = config.socket_timeout_s / 2
        self._claim_idle_ms = max(1, int(config.claim_idle_s * 1000))
        # An entry becomes claimable claim_idle_s after its delivery: scanning
        # more often than every half of that finds little.
        self._claim_every_s = max(config.claim_idle_s / 2, 0.05)
        self._next_claim_s = 0.0
        self._claim_cursor: bytes = b"0-0"
        self._history_id: bytes | None = b"0"  # own pending entries to re-read; None once done
        self._held: dict[str, bytes] = {}  # rollout_id -> entry id, delivered and not acked
        self._held_ids: set[bytes] = set()
        self.rejections = Rejections()
        self.received = 0
        self.acked = 0
        self.claimed = 0
        self.duplicates = 0
        self.outage = OutageWait(config, clock, sleep)
        try:
            # From id 0: rollouts written before the first learner started are read too.
            self.outage.call(
                lambda: self._client.xgroup_create(config.stream, config.consumer_group, id="0", mkstream=True)
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def get(self, max_items: int, timeout_s: float) -> list[Rollout]:
        """Up to ``max_items`` rollouts within ``timeout_s``, also while Redis is down (then often none).

        Raises :class:`RedisOutage` once an outage outlasts ``buffer.outage_tolerance_s``.
        """
        deadline = self._clock() + timeout_s
        out: list[Rollout] = []
        try:
            while self._history_id is not None and len(out) < max_items:
                out += self._read_history(max_items - len(out), deadline)
            while len(out) < max_items:
                now = self._clock()
                if now >= self._next_claim_s:
                    out += self._reclaim(max_items - len(out), deadline)
                    if len(out) >= max_items:
                        break
                    now = self._clock()
                # Block only while empty-handed, and wake up in time for the next reclaim scan.
                wait_s = 0.0 if out else min(deadline - now, self._block_cap_s, self._next_claim_s - now)
                out += self._accept(self._read_new(max_items - len(out), int(wait_s * 1000), deadline))
                if out or self._clock() >= deadline:
                    break
        except StillDown:
            pass  # down at our deadline: what was accepted is handed out; the next call waits on
        self.received += len(out)
        return out

    def _read_new(self, count: int, block_ms: int, deadline: float) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries never delivered to any consumer (``>``), waiting up to ``block_ms`` for the first."""
        c = self._config

        def read() -> Any:
            try:
                return self._new_client.xreadgroup(
                    c.consumer_group,
                    self.consumer,
                    {c.stream: ">"},
                    count=count,
                    block=block_ms if block_ms > 0 else None,  # BLOCK 0 = forever
                )
            except (redis.ConnectionError, redis.TimeoutError):
                # The reply may be lost after Redis moved entries to our pending list: re-read that next.
                self._history_id = b"0"
                raise

        return _entries(self.outage.call(read, until=deadline))

    def _read_history(self, count: int, deadline: float) -> list[Rollout]:
        """This consumer's pending entries after ``_history_id`` that it does not hold: unacked reads
        of a previous run, or reads whose reply was lost."""
        c = self._config
        history_id = self._history_id
        entries = _entries(
            self.outage.call(
                lambda: self._client.xreadgroup(
                    c.consumer_group,
                    self.consumer,
                    {c.stream: history_id},
                    count=count,
                ),
                until=deadline,
            )
        )
        if not entries:
            self._history_id = None
            return []
        self._history_id = entries[-1][0]
        entries = [(entry_id, fields) for entry_id, fields in entries if entry_id not in self._held_ids]
        if entries:
            log.info("re-reading %d pending entries of consumer %s", len(entries), self.consumer)
        return self._accept(entries)

    def _reclaim(self, count: int, deadline: float) -> list[Rollout]:
        """Entries other consumers left pending for ``claim_idle_s``, one XAUTOCLAIM page."""
        c = self._config
        reply = self.outage.call(
            lambda: self._client.xautoclaim(
                c.stream,
                c.consumer_group,
                self.consumer,
                min_idle_time=self._claim_idle_ms,
                start_id=self._claim_cursor,
                count=count,
            ),
            until=deadline,
        )
        self._claim_cursor = reply[0]
        if self._claim_cursor in (b"0-0", "0-0"):  # a full pass over the PEL is done
            self._next_claim_s = self._clock() + self._claim_every_s
        # Our own held entries can be idle too (not acked yet); they are already handed out.
        entries = [(entry_id, fields) for entry_id, fields in reply[1] if entry_id not in self._held_ids]
        if entries:
            self.claimed += len(entries)
            log.warning(
                "reclaimed %d entries idle for over %.1fs (buffer.claim_idle_s) from other consumers",
                len(entries),
                c.claim_idle_s,
            )
        return self._accept(entries)

    def _accept(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Rollout]:
        """Decode entries; drop (XACK + XDEL) malformed ones and duplicates, keep going.

        A rollout rejected by its content (a NaN log-prob, a token past the vocabulary) whose ids could be
        read is held like the rest, and released when the learner acknowledges its drop: with the drops of
        its group's other members, at the checkpoint. A learner that resumes from the checkpoint before
        then reads it again, and lets its group go again, where the group would otherwise wait for a member
        that is gone."""
        out: list[Rollout] = []
        drop: list[bytes] = []
        for entry_id, fields in entries:
            if not fields:  # deleted while pending: nothing to deliver, only to release
                drop.append(entry_id)
                continue
            data = fields.get(FIELD)
            try:
                if data is None:
                    raise ProtocolError(f"no {FIELD.decode()!r} field (fields: {sorted(fields)[:5]})")
                rollout = decode_rollout(data, self.limits)  # the size cap first: nothing oversized is decoded
            except ProtocolError as exc:
                self.rejections.add(exc, f"stream entry {entry_id.decode()} of {self._config.stream!r}")
                # the learner acknowledges the drop of a rollout whose group it knows (learners.batcher)
                if exc.rollout_id and exc.group_id and exc.rollout_id not in self._held:
                    self._held[exc.rollout_id] = entry_id
                    self._held_ids.add(entry_id)
                else:
                    drop.append(entry_id)
                continue
            held = self._held.get(rollout.rollout_id)
            if held is not None and held != entry_id:  # a retried XADD that had gone through
                self.duplicates += 1
                drop.append(entry_id)
                log.warning(
                    "dropped stream entry %s: rollout %s is already held as entry %s",
                    entry_id.decode(),
                    rollout.rollout_id,
                    held.decode(),
                )
                continue
            self._held[rollout.rollout_id] = entry_id
            self._held_ids.add(entry_id)
            out.append(rollout)
        if drop:
            self._release(drop)
        return out

    def _release(self, entry_ids: list[bytes]) -> None:
        """XACK and XDEL together (MULTI), so the stream never keeps an acked entry around.

        Waits out an outage (repeating both is harmless): entries accepted
        alongside these are in hand and must not be lost to a deadline.
        """
        c = self._config

        def release() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.xack(c.stream, c.consumer_group, *entry_ids)
            pipe.xdel(c.stream, *entry_ids)
            pipe.execute()

        self.outage.call(release)

    def ack(self, rollout_ids: Sequence[str]) -> None:
        """Release held rollouts (XACK + XDEL), waiting out an outage up to ``buffer.outage_tolerance_s``."""
        entry_ids = [self._held[rid] for rid in dict.fromkeys(rollout_ids) if rid in self._held]
        if len(entry_ids) < len(rollout_ids):
            log.debug("ack: %d of %d rollout ids were not held", len(rollout_ids) - len(entry_ids), len(rollout_ids))
        if not entry_ids:
            return
        self._release(entry_ids)  # on error they stay held and pending: a retry or a reclaim frees them
        for rid in rollout_ids:
            entry_id = self._held.pop(rid, None)
            self._held_ids.discard(entry_id)
        self.acked += len(entry_ids)

    def stats(self) -> dict[str, float]:
        """Counters for ``asyncrl status``; never raises, and never waits out an outage.

        ``redis_outage_s`` is how long the current outage has lasted (0 when
        Redis answers), ``redis_outages`` how many there were. While Redis is
        known to be down nothing is asked of it; then, or when the one attempt
        here fails, only local counters come back, with ``redis_error``.
        """
        c = self._config
        out = {
            "received": float(self.received),
            "acked": float(self.acked),
            "rejected": float(self.rejections.total),
            "claimed": float(self.claimed),
            "duplicates": float(self.duplicates),
            "held": float(len(self._held)),
        }

        def lengths() -> list[Any]:
            pipe = self._status_client.pipeline(transaction=False)
            pipe.xlen(c.stream)
            pipe.xpending(c.stream, c.consumer_group)
            return pipe.execute()

        if self.outage.down_s == 0:
            try:
                length, pending = self.outage.call(lengths, until=self._clock())
                mine = sum(p["pending"] for p in pending["consumers"] if p["name"] == self.consumer.encode())
                out.update(
                    queued=float(length - pending["pending"]),
                    stream_length=float(length),
                    pending=float(pending["pending"]),
                    pending_mine=float(mine),
                )
            except Exception as exc:  # noqa: BLE001 (a status query must not take the learner down)
                if not isinstance(exc, (StillDown, RedisOutage)):  # OutageWait logs an outage once
                    log.warning("buffer stats: Redis at %s: %s", redact(c.redis_url), exc)
        if "queued" not in out:
            out["redis_error"] = 1.0
        out.update(redis_outage_s=self.outage.down_s, redis_outages=float(self.outage.outages))
        return out

    def close(self) -> None:
        self._client.close()
        self._status_client.close()
        self._new_client.close()
