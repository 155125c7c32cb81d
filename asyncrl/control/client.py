"""A generator's (or ``asyncrl status``'s) connection to the learner's control endpoint.

The client is a REQ socket that is closed and connected afresh after a
timeout, so a lost reply never wedges it. A request sent again carries its
``request_id``: a reply with tickets that was lost is answered again, not with
new tickets. Its timeouts are ZeroMQ polls, in real time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import tenacity
import zmq

from asyncrl.control.watch import VersionWatch
from asyncrl.wire.peers import HandshakeRefused
from asyncrl.wire.protocol import ErrorReply, Message, WorkRequest, decode, encode
from asyncrl.wire.sockets import Endpoint

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """The learner received a request and its handler failed; it keeps serving."""


class CoordinatorClient:
    """A generator's (or ``asyncrl status``'s) connection to the learner.

    A REQ socket whose reply never came is stuck in the wrong state, and one
    whose peer went away may block on send; after any timeout the socket is
    closed and a fresh one connected (ZeroMQ's "lazy pirate" pattern), so a
    learner that restarts is found again.
    """

    def __init__(self, address: str, timeout_s: float, curve_secret_file: str | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._curve_secret_file = curve_secret_file
        self._endpoint = self._connect()
        self._watches: list[VersionWatch] = []

    def _connect(self) -> Endpoint:
        endpoint = Endpoint(
            zmq.REQ, self.address, bind=False, field="coordinator.address", curve_secret_file=self._curve_secret_file
        )
        endpoint.socket.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        return endpoint

    def call(self, request: Message, expected: type) -> msgspec.Struct:
        """Send one request and wait up to ``timeout_s`` for its reply."""
        socket = self._endpoint.socket
        dropped = self._endpoint.disconnects()
        try:
            socket.send(encode(request))
            # Silence is waited out (a learner still starting); a connection that dropped will never answer.
            if self._endpoint.wait_for_reply(self.timeout_s, lambda: self._endpoint.disconnects() > dropped):
                reply = decode(socket.recv(), (expected, ErrorReply))
                if isinstance(reply, ErrorReply):
                    raise RemoteError(f"the learner at {self.address} failed to answer: {reply.reason}")
                return reply
        except zmq.Again:
            pass
        lost = self._endpoint.disconnects() > dropped
        why, refused = self._endpoint.trouble(), self._endpoint.refused
        self._endpoint.close()
        self._endpoint = self._connect()
        if refused:
            raise HandshakeRefused(f"the learner at {self.address} (coordinator.address) refused this client: {why}")
        if lost:  # a learner killed mid-request: no reply can come on this connection, even once it is back
            raise TimeoutError(f"no reply from the learner at {self.address}: the connection dropped before it came")
        raise TimeoutError(f"no reply from the learner at {self.address} within {self.timeout_s:g}s: {why}")

    def watch(
        self, request: Callable[[], WorkRequest], hold_s: float, clock: Callable[[], float] = time.monotonic
    ) -> VersionWatch:
        """A request held for the learner's next version (``hold_s`` at most), on a socket of its own, looked at
        without waiting (:class:`~asyncrl.control.watch.VersionWatch`); closed with this client."""
        watch = VersionWatch(self.address, request, hold_s + self.timeout_s, self._curve_secret_file, clock)
        self._watches.append(watch)
        return watch

    def close(self) -> None:
        for watch in self._watches:
            watch.close()
        self._endpoint.close()


def wait_for_reply(client: CoordinatorClient, request: Message, expected: type, patience_s: float) -> msgspec.Struct:
    """Retry a call until the learner answers, for up to ``patience_s``.

    Generators start before (or outlive) the learner; they retry rather than
    fail on the first timeout, and give up with a clear error after a bound.
    A timed-out call has already waited ``coordinator.timeout_s``; an error
    reply comes at once, so retries after one back off (0.1 s doubling to 2 s).
    """
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type((TimeoutError, RemoteError)),
        stop=tenacity.stop_after_delay(patience_s),
        wait=lambda state: (
            0.0 if isinstance(state.outcome.exception(), TimeoutError) else min(2.0, 0.1 * 2**state.attempt_number)
        ),
        before_sleep=lambda state: log.info(
            "waiting for the learner at %s: %s", client.address, state.outcome.exception()
        ),
        reraise=False,
    )
    try:
        return retrying(client.call, request, expected)
    except tenacity.RetryError as error:
        raise TimeoutError(
            f"the learner at {client.address} (coordinator.address) did not answer for {patience_s:.0f}s: "
            f"{error.last_attempt.exception()}"
        ) from None
