"""The durable buffer: a Redis stream read by a consumer group (its writer and reader live beside this module).

Generators ``XADD`` each rollout to one stream as a single field (``m``: the
msgpack bytes of :func:`asyncrl.wire.protocol.encode`; nothing is pickled). The
learner reads it through a consumer group, so every entry it was handed stays
in the group's pending list (PEL) until it is acknowledged: a learner that
crashes, or a Redis that restarts with AOF, loses nothing that was not acked.

Life of an entry::

    XADD (writer) -> unread -> XREADGROUP (reader) -> pending -> XACK + XDEL

Backpressure. The reader deletes every entry it acknowledges, in the same
MULTI as the XACK, so the stream holds exactly the unread entries plus the
pending ones, and ``unread = XLEN - XPENDING count``. ``buffer.capacity``
bounds *unread* entries, the same thing the ZMQ backend's high-water mark
bounds. Entries the learner holds (e.g. members of groups still incomplete)
do not count: counting them could deadlock a learner that waits for the rest
of a group while writers wait for it to free space. The writer checks and adds
in one Lua script, so several generators never overshoot ``capacity`` between
a check and an add, and a batch costs one round trip. While the buffer is full
``put`` polls (one cheap script call, 5-50 ms apart) until ``timeout_s`` runs
out, then raises :class:`BufferTimeout` with the number that went in. Nothing
is ever trimmed (no MAXLEN): unread rollouts are only removed by the learner.
This needs no XINFO ``lag`` (which Redis reports as null once a stream has
deletions). Needs Redis >= 7.0 (XAUTOCLAIM, and pending entries that were
deleted come back with empty fields rather than nil).

Delivery is at least once: a reply lost to a network error is retried
(``buffer.retries``), which can add a rollout twice; a reader drops a second
copy of a rollout it still holds, but the learner should tolerate repeats.

Outages. Every command runs through :class:`~buffers.redis_connection.OutageWait`
(see there): while Redis is unreachable a call waits with backoff, for up to
``buffer.outage_tolerance_s``, then raises :class:`RedisOutage`.

Recovery. A reader first re-reads its own pending entries (``XREADGROUP``
from id ``0``), so a learner restarted under the same ``buffer.consumer`` name
gets back what it had read but not acked; then it reclaims entries that other
(dead) consumers left pending for ``claim_idle_s`` with XAUTOCLAIM; then it
reads new entries (``>``). ``claim_idle_s`` must exceed the longest time a
live learner holds an entry before acking it, or a second learner would steal
it. ``buffer.consumer`` is stable across restarts (default ``learner-0``),
so a resumed learner gets its own pending entries back at once; a consumer
renamed between runs gets them back only by reclaim.

ACL users need, on the stream's key: ``+ping +evalsha +script|load +xadd
+xlen +xpending`` (writer) and ``+ping +xgroup|create +xreadgroup +xautoclaim
+xack +xdel +xlen +xpending +multi +exec`` (reader).
"""

from __future__ import annotations

from typing import Any

FIELD = b"m"  # the one field of an entry: the encoded Rollout


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The (id, fields) pairs of an XREADGROUP reply, RESP2 list or RESP3 dict."""
    if isinstance(reply, dict):
        return [entry for value in reply.values() for entry in value[0]]
    return [entry for _, entries in reply or [] for entry in entries]
