"""An in-process buffer: a bounded queue shared by name, for tests and serial runs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from asyncrl.wire.protocol import Rollout
from buffers.base import BufferTimeout, Rejections

_queues: dict[str, queue.Queue] = {}
_lock = threading.Lock()


def _queue(name: str, capacity: int) -> queue.Queue:
    with _lock:
        return _queues.setdefault(name, queue.Queue(maxsize=capacity))


class InprocWriter:
    """Writes into the named queue; ``put`` blocks while it is full."""

    durable = True  # the queue lives in the learner's process

    def __init__(self, name: str, capacity: int) -> None:
        self._queue = _queue(name, capacity)

    def put(self, rollouts: Sequence[Rollout], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for sent, rollout in enumerate(rollouts):
            try:
                self._queue.put(rollout, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                raise BufferTimeout(f"in-process buffer full for {timeout_s:.1f}s", sent) from None

    def close(self, linger_s: float = 0.0) -> None:
        pass


class InprocReader:
    """Reads from the named queue. Objects never leave the process: nothing to reject."""

    busy_s = None

    def __init__(self, name: str, capacity: int) -> None:
        self._queue = _queue(name, capacity)
        self.rejections = Rejections()
        self.received = 0

    def get(self, max_items: int, timeout_s: float) -> list[Rollout]:
        out: list[Rollout] = []
        try:
            out.append(self._queue.get(timeout=timeout_s))
            while len(out) < max_items:
                out.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        self.received += len(out)
        return out

    def ack(self, rollout_ids: Sequence[str]) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"queued": self._queue.qsize(), "received": self.received, "rejected": self.rejections.total}

    def close(self) -> None:
        pass
