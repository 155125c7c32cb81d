"""The two halves of a rollout buffer, as Protocols.

Generators hold a :class:`RolloutWriter`, learners a :class:`RolloutReader`.
A backend implements both; :func:`buffers.open_writer` /
:func:`buffers.open_reader` are the only places that switch on its name.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from asyncrl.wire.protocol import ProtocolError, Rollout

log = logging.getLogger(__name__)


class BufferTimeout(TimeoutError):
    """The buffer stayed full for longer than the allowed wait.

    ``sent`` rollouts of the batch went in before it did; a retry sends the rest.
    """

    def __init__(self, message: str, sent: int) -> None:
        super().__init__(message)
        self.sent = sent


class Rejections:
    """Entries a reader refused, counted by reason; the learner drains them to release their groups.

    Only the first few of each reason are logged in full, then every
    thousandth: a peer that floods the buffer with junk cannot flood the log.
    """

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self._undrained: list[ProtocolError] = []
        # A reader's receiving thread adds while the learner drains: an add to the list just handed over
        # would never be drained, and its group would wait out ticket_timeout_s.
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def add(self, error: ProtocolError, where: str) -> None:
        """Count ``error`` under its reason and keep it for :meth:`drain`; ``where`` names the entry in the log."""
        with self._lock:
            self.by_reason[error.reason] += 1
            self._undrained.append(error)
            count = self.by_reason[error.reason]
        if count <= 10 or count % 1000 == 0:
            log.warning("rejected %s (%s #%d): %s", where, error.reason, count, error)

    def drain(self) -> list[ProtocolError]:
        """Rejections since the last call (each carries ``.rollout`` where the entry decoded)."""
        with self._lock:
            out, self._undrained = self._undrained, []
        return out


class RolloutWriter(Protocol):
    """The generator side: appends rollouts, blocking while the buffer is full.

    ``durable``: a rollout whose :meth:`put` returned reaches the learner even
    if this process ends right after (Redis, or a queue in the learner's own
    process); False where it may still be queued in this process (ZeroMQ).
    """

    durable: bool

    def put(self, rollouts: Sequence[Rollout], timeout_s: float) -> None:
        """Append all of ``rollouts`` or raise :class:`BufferTimeout`."""
        ...

    def close(self, linger_s: float = 0.0) -> None:
        """Close; where :meth:`put` returns before a rollout has left the process (ZeroMQ queues it), wait up
        to ``linger_s`` for those still queued to leave. Closing twice is harmless."""
        ...


class RolloutReader(Protocol):
    """The learner side: takes rollouts out, and acknowledges them once trained on.

    ``rejections`` counts entries that failed the size cap, decoding or
    :meth:`~asyncrl.wire.protocol.Rollout.problem`, by reason; they are skipped
    (and, on durable backends, acknowledged as dropped), never returned.
    """

    rejections: Rejections
    # Seconds get() spent on its own work, waits excluded, for backends that tell them apart (None elsewhere: a
    # read that found data counts as work). A plain attribute: reading it costs no round trip to a server.
    busy_s: float | None

    def get(self, max_items: int, timeout_s: float) -> list[Rollout]:
        """Up to ``max_items`` rollouts; fewer (maybe none) once ``timeout_s`` passes."""
        ...

    def ack(self, rollout_ids: Sequence[str]) -> None:
        """Mark rollouts as done: trained on by a checkpointed step, or dropped."""
        ...

    def stats(self) -> dict[str, float]:
        """Backend counters for ``asyncrl status`` (queued, received, rejected...)."""
        ...

    def close(self) -> None:
        """Stop reading and release the backend's connections. What was read and not acked stays pending on
        a durable backend (Redis), which delivers it again to the next reader."""
        ...
