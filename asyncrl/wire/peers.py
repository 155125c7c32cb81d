"""Why a client's peer does not answer, from ZeroMQ's socket monitor: nothing listens, the handshake failed (and
whether waiting can mend it), the connection dropped, or the peer is connected and silent."""

from __future__ import annotations

import zmq


class HandshakeRefused(RuntimeError):
    """The peer took the connection and refused the handshake: a CURVE key that differs, or CURVE on one end
    only. Unlike silence, waiting does not mend it."""


class PeerWatch:
    """A client socket's connection events (ZeroMQ's socket monitor), read when a reply is overdue, to say why:
    nothing listens at the address, the handshake failed (a CURVE key that differs, or CURVE on one side only),
    or the peer connected and did not answer."""

    _FAILED = {
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    }
    _MISMATCH = getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", -1)

    def __init__(self, socket: zmq.Socket, curve: bool, secret_field: str) -> None:
        self.curve, self.secret_field = curve, secret_field  # the config key naming the CURVE secret
        self.monitor = socket.get_monitor_socket()
        # How the latest connection attempt went: "" (none yet), "unreachable" (refused or unanswered),
        # "connected" (no handshake yet), "failed" (its handshake), "up", or "dropped" (after its handshake).
        self.last = ""
        self.mismatch = False  # a handshake failed because CURVE is on at one end only: waiting will not mend it
        self.key_refused = False  # the peer's authenticator refused this end's key: nor will it mend that
        self.retries = 0  # connection attempts refused or unanswered
        self.disconnects = 0  # connections that dropped after their handshake (as of the last :meth:`read`)
        self.down = False  # an attempt failed or a connection dropped since the last handshake: none is up

    @property
    def refused(self) -> bool:
        """Whether the peer refused the handshake for a reason no wait mends (CURVE on at one end only, or a key
        it does not take), as of the last :meth:`read`. A handshake cut short with no reason is not: a proxy
        whose service is not up yet does that too."""
        return self.mismatch or self.key_refused

    def read(self) -> None:
        """Take in the events that arrived since the last read."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.last = "connected"
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.last, self.down = "up", False
            elif kind in self._FAILED:
                self.last = "failed"
                self.mismatch |= event["value"] == self._MISMATCH
                self.key_refused |= kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            elif kind == zmq.EVENT_CLOSED:  # an attempt that never connected
                self.last = "unreachable"
            elif kind == zmq.EVENT_CONNECT_RETRIED:  # after a refused attempt, or a connection that dropped
                self.retries += 1
                self.down = True
            elif kind == zmq.EVENT_DISCONNECTED and self.last == "up":  # not a handshake refused: that is "failed"
                self.disconnects, self.last = self.disconnects + 1, "dropped"

    def trouble(self) -> str:
        """Why no answer came, as far as the latest connection attempt tells."""
        self.read()
        field = self.secret_field
        if self.mismatch:
            if self.curve:
                return f"the handshake failed: this end has CURVE on ({field}) and the peer does not"
            return f"the handshake failed: the peer has CURVE on and this end does not (set {field})"
        if self.key_refused:
            return (
                f"the handshake failed: the peer refused this end's key (give both ends the run's key files: {field})"
            )
        if self.last == "failed" and self.curve:
            return (
                "the handshake failed: the peer closed the connection during it: its CURVE key may not be this "
                f"run's (give both ends the run's key files: {field}), or it is a proxy whose service is not up"
            )
        if self.last == "failed":
            return (
                "the handshake failed: the peer closed the connection during it: it may have CURVE on where this "
                f"end does not (set {field}), or be a proxy whose service is not up, or not an asyncrl service"
            )
        if self.last in ("up", "connected"):
            return "connected, and the peer did not answer in time"
        if self.last == "dropped":
            return "the connection dropped: the peer stopped, or the network between went down"
        if self.retries or self.last == "unreachable":
            return "no connection: nothing accepts connections at that address (refused or unreachable)"
        return "no connection yet"

    def close(self, socket: zmq.Socket) -> None:
        socket.disable_monitor()
        self.monitor.close(linger=0)
