"""The Redis Streams buffer's writing end: rollouts added to the stream, waiting for room and out an outage."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from asyncrl.config import BufferConfig
from asyncrl.wire.protocol import Rollout, encode
from buffers.base import BufferTimeout
from buffers.redis_buffer import FIELD
from buffers.redis_connection import OutageWait, connect, redact

# KEYS[1] stream; ARGV: group, capacity, field, payload... -> {added, unread before adding}.
# Atomic, so concurrent writers cannot both see room for the same slot.
_ADD_SCRIPT = """
local unread = redis.call('XLEN', KEYS[1])
if unread > 0 then
  local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
  if type(summary) == 'table' and summary.err == nil then unread = unread - summary[1] end
end
local n = math.min(tonumber(ARGV[2]) - unread, #ARGV - 3)
for i = 1, n do redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[i + 3]) end
return {math.max(n, 0), unread}
"""


class RedisWriter:
    """A generator's side: XADDs batches, waiting while ``capacity`` rollouts are unread."""

    durable = True  # a put returns once Redis holds the entries

    def __init__(
        self,
        config: BufferConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._config = config
        self._client = connect(config)
        self._add = self._client.register_script(_ADD_SCRIPT)
        self._clock, self._sleep = clock, sleep
        self.outage = OutageWait(config, clock, sleep)

    def _try_add(self, payloads: Sequence[bytes]) -> tuple[int, int]:
        """Add as many of ``payloads`` as fit; returns (added, unread before). One round trip."""
        c = self._config
        added, unread = self._add(keys=[c.stream], args=[c.consumer_group, c.capacity, FIELD, *payloads])
        return int(added), int(unread)

    def put(self, rollouts: Sequence[Rollout], timeout_s: float) -> None:
        """Add all of ``rollouts``: ``timeout_s`` bounds the wait for room, an outage is waited out on top.

        Raises :class:`BufferTimeout` (with ``sent``) when the buffer stays full,
        :class:`RedisOutage` when Redis stays away past ``buffer.outage_tolerance_s``.
        """
        deadline = self._clock() + timeout_s
        payloads = [encode(rollout) for rollout in rollouts]
        capacity = self._config.capacity
        sent, room, pause = 0, True, 0.005
        while sent < len(payloads):
            # Send the rest while there is room; while full, poll with an empty batch (cheap).
            batch = payloads[sent:] if room else ()
            failures, started = self.outage.failures, self._clock()
            added, unread = self.outage.call(lambda batch=batch: self._try_add(batch))
            if self.outage.failures != failures:  # time spent waiting for Redis is not time spent full
                deadline += self._clock() - started
            sent += added
            room = unread + added < capacity
            if room or sent == len(payloads):
                pause = 0.005
                continue
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise BufferTimeout(
                    f"redis stream {self._config.stream!r} at {redact(self._config.redis_url)} stayed full "
                    f"({unread + added} unread >= buffer.capacity {capacity}) for {timeout_s:.1f}s",
                    sent,
                )
            self._sleep(min(pause, remaining))
            pause = min(pause * 2, 0.05)

    def close(self, linger_s: float = 0.0) -> None:  # a put returns once Redis has the entries: none linger
        self._client.close()
