"""The two halves of a rollout buffer, as Protocols.

Generators hold a :class:`RolloutWriter`, learners a :class:`RolloutReader`.
A backend implements both; :func:`buffers.open_writer` /
:func:`buffers.open_reader` are the only places that switch on its name.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from asyncrl.protocol import Rollout


class BufferTimeout(TimeoutError):
    """The buffer stayed full for longer than the allowed wait.

    ``sent`` rollouts of the batch went in before it did; a retry sends the rest.
    """

    def __init__(self, message: str, sent: int) -> None:
        super().__init__(message)
        self.sent = sent


class RolloutWriter(Protocol):
    """The generator side: appends rollouts, blocking while the buffer is full."""

    def put(self, rollouts: Sequence[Rollout], timeout_s: float) -> None:
        """Append all of ``rollouts`` or raise :class:`BufferTimeout`."""
        ...

    def close(self) -> None: ...


class RolloutReader(Protocol):
    """The learner side: takes rollouts out, and acknowledges them once trained on.

    ``rejected`` counts entries that failed to decode or validate; they are
    skipped (and, on durable backends, acknowledged as dropped), never
    returned.
    """

    rejected: int

    def get(self, max_items: int, timeout_s: float) -> list[Rollout]:
        """Up to ``max_items`` rollouts; fewer (maybe none) once ``timeout_s`` passes."""
        ...

    def ack(self, rollout_ids: Sequence[str]) -> None:
        """Mark rollouts as done: trained on by a checkpointed step, or dropped."""
        ...

    def stats(self) -> dict[str, float]:
        """Backend counters for ``asyncrl status`` (queued, received, rejected...)."""
        ...

    def close(self) -> None: ...
