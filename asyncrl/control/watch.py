"""A generator hears of the learner's new versions between two engine steps, without waiting on the learner.

A generator in mid-batch keeps one request open at the learner's control
endpoint: a work request for no tickets, which the learner holds (for up to
``coordinator.long_poll_s``) until it publishes a new version. Between two
engine steps the generator only looks whether the answer has come; when it
has, the generator asks for the version to take (the answer may have waited
in the socket) and the next look sends the next watch. New weights so land
within one engine step of their publication, the engine waits on the learner
for one request per version, and the learner hears from a generator twice
per version or long poll instead of once per poll interval. The held request
also renews the generator's lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from asyncrl.wire.protocol import ErrorReply, ProtocolError, WorkReply, WorkRequest, decode, encode
from asyncrl.wire.sockets import DROP_CHECK_S, Endpoint

log = logging.getLogger(__name__)


class VersionWatch:
    """One held request for the learner's next version, looked at without blocking.

    ``request`` makes each request (a work request for no tickets, with
    ``wait_s`` set). An answer that has not come ``patience_s`` after its
    request, or whose connection dropped, is given up: the socket is made
    afresh (a REQ socket cannot send again before its reply) and the next
    look sends a new request.
    """

    def __init__(
        self,
        address: str,
        request: Callable[[], WorkRequest],
        patience_s: float,
        curve_secret_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self._request = request
        self.patience_s = patience_s
        self._curve_secret_file = curve_secret_file
        self._clock = clock
        self._endpoint: Endpoint | None = None
        self._sent_at: float | None = None  # when the request in flight went out; None: none in flight
        self._dropped = 0  # the connection's drops when the request in flight went out
        self._checked_at = 0.0  # when the connection was last looked at
        self.answers = 0
        self.lost = 0  # requests given up on

    def newest(self) -> WorkReply | None:
        """The learner's answer if it came since the last look, else None. A look with no request in flight
        sends one, stating the weights the generator holds by then."""
        if self._sent_at is None:
            self._send()
            return None
        socket = self._endpoint.socket
        if socket.poll(0, zmq.POLLIN):
            self._sent_at = None  # the next look asks again, once the caller has taken this answer's weights
            return self._read(socket.recv())
        now = self._clock()
        if now - self._sent_at > self.patience_s or self._dropped_since_sent(now):
            self.lost += 1
            log.info("a version watch at %s went unanswered; asking afresh (%d so far)", self.address, self.lost)
            self._reset()
        return None

    def _read(self, raw: bytes) -> WorkReply | None:
        try:
            reply = decode(raw, (WorkReply, ErrorReply))
        except ProtocolError as exc:
            log.warning("a version watch at %s got an unreadable answer: %s", self.address, exc)
            return None
        if isinstance(reply, ErrorReply):
            log.warning("the learner at %s failed to answer a version watch: %s", self.address, reply.reason)
            return None
        self.answers += 1
        return reply

    def _send(self) -> None:
        if self._endpoint is None:
            self._endpoint = Endpoint(
                zmq.REQ,
                self.address,
                bind=False,
                field="coordinator.address",
                curve_secret_file=self._curve_secret_file,
            )
        # Drops counted from this request on: one while no request was in flight (a learner restarted between
        # two watches) does not make this one lost.
        self._dropped = self._endpoint.disconnects()
        try:
            self._endpoint.socket.send(encode(self._request()), zmq.NOBLOCK)
        except zmq.Again:  # no connection to queue it on yet: the next look tries again
            self._reset()
            return
        self._sent_at = self._checked_at = self._clock()

    def _dropped_since_sent(self, now: float) -> bool:
        """Whether the connection dropped under the request in flight, looked at every ``DROP_CHECK_S`` at most
        (reading the socket's monitor costs more than a look for the answer)."""
        if now - self._checked_at < DROP_CHECK_S:
            return False
        self._checked_at = now
        return self._endpoint.disconnects() > self._dropped

    def _reset(self) -> None:
        self.close()
        self._sent_at = None

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
