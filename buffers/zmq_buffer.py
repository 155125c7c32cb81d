"""The embedded default buffer: ZeroMQ PUSH (generators) to PULL (learner).

No broker: the learner binds a PULL socket and every generator connects a
PUSH socket to it. Each rollout travels as one msgpack frame. ``capacity`` is
the sockets' high-water mark: once the learner's receive queue and a writer's
send queue each hold ``capacity`` rollouts (plus what the kernel's TCP
buffers absorb), ``put`` gets EAGAIN and retries until ``timeout_s``, which
is the backpressure a generator feels. The hard bound on rollouts in flight
is the learner's admission control (``asyncrl.control.staleness``): no generator
holds a ticket for more than ``max_staleness + 1`` versions of samples.
PUSH never drops on a full queue, it refuses, so nothing is silently lost
between live processes. What sits in socket queues when a process dies is
lost; the learner's staleness accounting releases it, and the Redis backend
is the one to use when a run must survive crashes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import zmq

from asyncrl.wire.protocol import ProtocolError, Rollout, RolloutLimits, decode_rollout, encode
from asyncrl.wire.sockets import Endpoint
from buffers.base import BufferTimeout, Rejections

log = logging.getLogger(__name__)


class ZmqWriter:
    """A generator's PUSH socket connected to the learner's PULL socket."""

    durable = False  # a put returns once its frame is queued here

    def __init__(self, address: str, capacity: int, curve_secret_file: str | None = None) -> None:
        self._endpoint = Endpoint(
            zmq.PUSH,
            address,
            bind=False,
            field="buffer.address",
            curve_secret_file=curve_secret_file,
            hwm=capacity,
        )

    def put(self, rollouts: Sequence[Rollout], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        socket = self._endpoint.socket
        for sent, rollout in enumerate(rollouts):
            frame = encode(rollout)
            while True:
                try:
                    socket.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        raise BufferTimeout(
                            f"buffer at {socket.getsockopt_string(zmq.LAST_ENDPOINT)} (buffer.address) stayed full "
                            f"for {timeout_s:.1f}s: {self._endpoint.trouble()}",
                            sent,
                        ) from None
                    socket.poll(50, zmq.POLLOUT)

    def close(self, linger_s: float = 0.0) -> None:
        # put() returns once a frame is queued in this process: closing without linger drops what is still
        # queued, which a drained generator must not (the learner settles its tickets only as groups arrive).
        self._endpoint.close(linger_s)


class ZmqReader:
    """The learner's PULL socket; frames over the size cap or failing validation are counted and skipped.

    A receiver thread owns the socket: it receives, decodes and checks each
    rollout while the learner trains, into a queue of ``capacity`` rollouts,
    so :meth:`get` only hands over what is already decoded. When the queue is
    full the thread stops receiving, the socket's own queue fills, and
    writers feel the backpressure as before.

    Two size guards: a frame over ``limits.max_bytes`` is received and
    rejected (counted as ``oversize``) without being decoded; libzmq itself
    refuses anything over twice that plus 1 MiB (``MAXMSGSIZE``) before
    allocating it, dropping the sender's connection, so no peer can make the
    learner hold an arbitrarily large frame.
    """

    def __init__(
        self, address: str, capacity: int, limits: RolloutLimits, curve_secret_file: str | None = None
    ) -> None:
        self._endpoint = Endpoint(
            zmq.PULL,
            address,
            bind=True,
            field="buffer.address",
            curve_secret_file=curve_secret_file,
            hwm=capacity,
            max_message_bytes=2 * limits.max_bytes + 2**20,
        )
        self.limits = limits
        self.rejections = Rejections()
        self.received = 0
        self.bytes_received = 0
        self.busy_s = 0.0  # handing rollouts over in get(), waits excluded: the learner's share of the work
        self.decode_s = 0.0  # receiving and decoding, on the receiver thread
        self._ready: queue.Queue[Rollout] = queue.Queue(maxsize=capacity)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="buffer.address", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        socket = self._endpoint.socket
        while not self._closing.is_set():
            if not socket.poll(100):
                continue
            started = time.perf_counter()
            frame = socket.recv()
            self.bytes_received += len(frame)
            try:
                rollout = decode_rollout(frame, self.limits)
            except ProtocolError as exc:
                self.rejections.add(exc, "a buffer entry")
                rollout = None
            self.decode_s += time.perf_counter() - started
            while rollout is not None and not self._closing.is_set():
                try:
                    self._ready.put(rollout, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def get(self, max_items: int, timeout_s: float) -> list[Rollout]:
        out: list[Rollout] = []
        try:
            out.append(self._ready.get(timeout=max(0.0, timeout_s)))  # block for the first rollout only
        except queue.Empty:
            return out
        started = time.perf_counter()
        while len(out) < max_items:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                break
        self.busy_s += time.perf_counter() - started
        self.received += len(out)
        return out

    def ack(self, rollout_ids: Sequence[str]) -> None:
        pass  # nothing durable to acknowledge

    def stats(self) -> dict[str, float]:
        return {
            "received": self.received,
            "rejected": self.rejections.total,
            "bytes": self.bytes_received,
            "busy_s": self.busy_s,
            "decode_s": self.decode_s,
            "decoded_waiting": self._ready.qsize(),
        }

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        self._endpoint.close()
