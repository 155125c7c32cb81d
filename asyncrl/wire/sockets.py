"""ZeroMQ socket set-up shared by the buffer and the coordinator.

Rules every socket here follows, learned the hard way with libzmq:

* ``tcp://`` only: ``ipc://`` can lose the last messages at shutdown.
* ``LINGER = 0`` on every socket, and contexts are destroyed rather than
  terminated: ``Context.term()`` blocks while any socket is open, so relying
  on linger to flush turns a shutdown into a hang. Delivery that matters is
  acknowledged at the application level instead. The one bounded exception:
  a drained generator closes its rollout writer with a linger of
  ``buffer.timeout_s``, so that what it already handed over leaves.
* Binding anywhere but loopback requires a shared secret: a CURVE
  certificate (``asyncrl keys``) that the server and every client hold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from asyncrl.wire.peers import PeerWatch
from asyncrl.wire.ports import check_address, is_loopback
from asyncrl.wire.protocol import ErrorReply, ProtocolError, decode, encode

log = logging.getLogger(__name__)

# Requests are small (an evaluation's report, the largest, is text): a peer sending more is disconnected by ZeroMQ
# before the learner holds it in memory.
MAX_REQUEST_BYTES = 64 * 2**20
DROP_CHECK_S = 0.5  # a client waiting for a reply looks this often whether its connection dropped


def create_certificate(path: str | os.PathLike) -> Path:
    """Write a CURVE key pair that servers and clients of one run share.

    The file holds a secret key: keep it readable by the run's user only.
    """
    import zmq.auth

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(str(out.parent), out.stem)
    os.chmod(secret_file, 0o600)
    return Path(secret_file)


def _load_keys(secret_file: str) -> tuple[bytes, bytes]:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise ValueError(f"{secret_file}: holds no secret key (use the .key_secret file)")
    return public, secret


class _OnlyKey:
    """A CURVE credentials provider that admits one public key."""

    def __init__(self, public_key: bytes) -> None:
        self._key = public_key  # z85, as the certificate file holds it and the authenticator hands keys over

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


class Endpoint:
    """One socket plus the CURVE authenticator a server needs; closed together."""

    def __init__(
        self,
        socket_type: int,
        address: str,
        *,
        bind: bool,
        field: str,
        curve_secret_file: str | None = None,
        hwm: int | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        check_address(address, field)
        if bind and not is_loopback(address) and not curve_secret_file:
            raise ValueError(
                f"{field}: {address} listens beyond loopback; set a curve_secret_file "
                "(create one with `asyncrl keys PATH`) so that only holders of the secret connect"
            )
        self.context = zmq.Context()
        self.socket = self.context.socket(socket_type)
        self.socket.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            self.socket.setsockopt(zmq.SNDHWM, hwm)
            self.socket.setsockopt(zmq.RCVHWM, hwm)
        if max_message_bytes is not None:
            self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._auth = None
        if curve_secret_file:
            public, secret = _load_keys(curve_secret_file)
            self.socket.curve_publickey = public
            self.socket.curve_secretkey = secret
            if bind:
                from zmq.auth.thread import ThreadAuthenticator

                self._auth = ThreadAuthenticator(self.context)
                self._auth.start()
                # Only peers presenting the run's own public key get in (not every key in its folder, which
                # may hold other runs' keys).
                self._auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(public))
                self.socket.curve_server = True
            else:
                self.socket.curve_serverkey = public
        # A client watches its connection, so that a peer that never answers can be told apart from one that
        # refuses the connection or the handshake (see :meth:`trouble`).
        secret_field = f"{field.split('.')[0]}.curve_secret_file"
        self._watch = None if bind else PeerWatch(self.socket, bool(curve_secret_file), secret_field)
        try:
            if bind:
                self.socket.bind(address)
            else:
                self.socket.connect(address)
        except zmq.ZMQError as exc:  # "Address already in use", or a host that does not resolve
            self.close()
            raise RuntimeError(f"{field}: cannot {'bind' if bind else 'connect to'} {address}: {exc}") from None
        self.address, self.field = address, field

    def trouble(self) -> str:
        """Why a client's peer has not answered, as far as the connection tells: ``"no connection: ..."``, ``"the
        handshake failed: ..."``, or that it connected and the peer is silent."""
        return self._watch.trouble() if self._watch is not None else "a server does not wait for a peer"

    @property
    def refused(self) -> bool:
        """Whether a client's last handshake failed (as of the last :meth:`trouble`)."""
        return self._watch is not None and self._watch.refused

    def disconnects(self) -> int:
        """How many times a client's connection has dropped after its handshake, so far (a server: 0).

        A request sent over a connection that then drops is never answered,
        even by a peer that restarts at once: a client waiting for a reply can
        stop as soon as this count grows.
        """
        if self._watch is None:
            return 0
        self._watch.read()
        return self._watch.disconnects

    def down(self) -> bool:
        """Whether a client has no connection up: an attempt was refused or went unanswered, or the connection
        dropped, since the last handshake (a server: False)."""
        if self._watch is None:
            return False
        self._watch.read()
        return self._watch.down

    def wait_for_reply(self, timeout_s: float, give_up: Callable[[], bool]) -> bool:
        """Wait up to ``timeout_s`` for a reply, looking every ``DROP_CHECK_S`` whether to ``give_up`` on it
        (its connection dropped, say); whether it came. The poll is ZeroMQ's, in real time."""
        deadline = time.monotonic() + timeout_s
        while not self.socket.poll(int(min(DROP_CHECK_S, max(0.0, deadline - time.monotonic())) * 1000)):
            if give_up() or time.monotonic() >= deadline:
                return False
        return True

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket and destroy the context, waiting up to ``linger_s`` for queued messages to leave."""
        if getattr(self, "_watch", None) is not None:
            self._watch.close(self.socket)
            self._watch = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        linger_ms = int(linger_s * 1000)
        self.socket.close(linger=linger_ms)
        self.context.destroy(linger=linger_ms)


class RequestServer:
    """Answers requests on a ROUTER socket from one daemon thread.

    ``handle(request, final)`` gets each decoded request (of the ``accepts``
    types) and returns the reply. Nothing a peer sends can stop the thread: a
    malformed request is counted in ``rejected``, logged and left unanswered,
    and a handler that raises is counted in ``errors``, logged with its
    traceback and answered with an :class:`~asyncrl.wire.protocol.ErrorReply`, so
    the caller hears of it at once instead of waiting out its timeout. A
    request over ``max_request_bytes`` is never read: ZeroMQ drops its peer.

    Long polls: a request with a ``wait_s`` field may be held that long (at
    most ``max_hold_s``) while its handler answers ``None`` ("nothing for you
    yet"). Held requests are asked again after every :meth:`wake` and every
    ``recheck_s``, and once their time is up with ``final=True``, when the
    handler must answer. A waiting caller hears of new work at once instead of
    sleeping and asking again.

    Holds are timed by ``clock`` (``time.monotonic`` unless a test passes a
    fake one): a held request is answered with ``final=True`` once the clock
    reaches its deadline, at the next recheck. A request ``rechecked`` says
    False for is asked again only after a :meth:`wake` or at its deadline:
    one held for long (a generator's watch for the next version) then costs
    the serving process nothing while it waits.
    """

    def __init__(
        self,
        address: str,
        field: str,
        accepts: type | tuple[type, ...],
        handle: Callable[[msgspec.Struct, bool], msgspec.Struct | None],
        curve_secret_file: str | None = None,
        max_hold_s: float = 0.0,
        recheck_s: float = 0.01,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        clock: Callable[[], float] = time.monotonic,
        rechecked: Callable[[msgspec.Struct], bool] = lambda request: True,
    ) -> None:
        self.rejected = 0
        self._rechecked = rechecked  # False: a held request whose answer only a wake() or its deadline changes
        self._turns = 0  # times the serving loop has looked (tests wait on it)
        self.errors = 0
        self._accepts, self._handle, self._field = accepts, handle, field
        self._max_hold_s, self._recheck_ms = max_hold_s, max(1, int(recheck_s * 1000))
        self._clock = clock
        self._held: list[tuple[list[bytes], msgspec.Struct, float]] = []  # (envelope, request, deadline)
        self._endpoint = Endpoint(
            zmq.ROUTER,
            address,
            bind=True,
            field=field,
            curve_secret_file=curve_secret_file,
            max_message_bytes=max_request_bytes,
        )
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=field, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Ask held requests again now (their answer may have changed); callable from any thread."""
        with contextlib.suppress(BlockingIOError):  # a wake-up already pending is enough
            self._wake_out.send(b"\0")

    def _serve(self) -> None:
        router = self._endpoint.socket
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._closing.is_set():
            try:
                self._serve_once(router, poller)
            except Exception:  # noqa: BLE001  (the last line of defence: this thread is the control plane)
                self.errors += 1
                log.exception("%s: serving a request failed (%d so far); serving on", self._field, self.errors)
                time.sleep(0.1)  # a fault that repeats fills the log at this pace, not at the CPU's

    def _serve_once(self, router, poller) -> None:
        self._turns += 1
        rechecking = any(self._rechecked(request) for _, request, _ in self._held)
        ready = dict(poller.poll(self._recheck_ms if rechecking else 100))
        woken = self._wake_in.fileno() in ready  # zmq's poller names plain sockets by file descriptor
        if woken:
            with contextlib.suppress(BlockingIOError):
                self._wake_in.recv(4096)
        if router in ready:
            self._receive(router)
        held, self._held = self._held, []
        now = self._clock()
        for envelope, request, deadline in held:
            if woken or now >= deadline or self._rechecked(request):
                self._respond(envelope, request, deadline)
            else:
                self._held.append((envelope, request, deadline))

    def _receive(self, router) -> None:
        # [routing envelope..., empty delimiter, body]; REQ_CORRELATE adds a request id.
        *envelope, body = router.recv_multipart()
        if not envelope or envelope[-1] != b"":
            self.rejected += 1
            return
        try:
            request = decode(body, self._accepts)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("%s: rejected a request (%d so far): %s", self._field, self.rejected, exc)
            return
        hold_s = min(float(getattr(request, "wait_s", 0.0) or 0.0), self._max_hold_s)
        held_before = len(self._held) < 1024  # a bound on what peers can park here
        self._respond(envelope, request, self._clock() + hold_s if hold_s > 0 and held_before else 0.0)

    def _respond(self, envelope: list[bytes], request: msgspec.Struct, deadline: float) -> None:
        """Answer ``request`` now, or hold it until ``deadline`` if its handler has nothing yet."""
        final = self._clock() >= deadline
        try:
            reply = self._handle(request, final)
        except Exception as exc:  # noqa: BLE001  (one bad request must not end the control plane)
            self.errors += 1
            log.exception("%s: a request handler failed (%d so far)", self._field, self.errors)
            reply = ErrorReply(reason=f"{type(exc).__name__}: {exc}")
        if reply is None and not final:
            self._held.append((envelope, request, deadline))
            return
        if reply is None:
            self.errors += 1
            log.error("%s: a handler gave no final answer to %s", self._field, type(request).__name__)
            reply = ErrorReply(reason="no answer")
        self._endpoint.socket.send_multipart([*envelope, encode(reply)])

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        self._endpoint.close()
        self._wake_in.close()
        self._wake_out.close()
