"""Connecting to Redis, and waiting out an outage: the part of the Redis buffer that is about the server.

Every command runs through :class:`OutageWait`: while Redis is
unreachable (connection refused or reset, socket timeouts, ``LOADING`` after a
restart) a call sleeps with jittered exponential backoff and tries again, for
up to ``buffer.outage_tolerance_s`` counted from the first failure of the
outage, then raises :class:`RedisOutage`. redis-py's own short retries
(``buffer.retries``) still absorb single blips, such as a pooled connection
that the server closed. Retrying is safe command by command: a retried XADD
that had gone through adds the rollout twice (the buffer delivers at least
once, and the reader drops a copy it still holds); a retried XACK + XDEL does nothing
new; a retried ``XREADGROUP >`` whose lost reply had moved entries to this consumer's pending
list makes the next ``get`` re-read that list. ``put`` waits out an outage on
top of its ``timeout_s`` (the wait for room), and ``get`` within its own
``timeout_s``, handing back what it has (maybe nothing) while the outage goes
on, so the learner's loop keeps turning and ``stats`` can report it. Redis must
come back with its data (AOF): a stream or group that is gone is an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import tenacity
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import AuthenticationError, ResponseError
from redis.retry import Retry

from asyncrl.config import BufferConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def _options(config: BufferConfig) -> dict[str, Any]:
    """Timeouts and credentials for a client of ``buffer.redis_url``."""
    options: dict[str, Any] = {
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.socket_timeout_s,
    }
    if config.redis_username:
        options["username"] = config.redis_username
    if config.redis_password_file:
        try:
            options["password"] = Path(config.redis_password_file).read_text().strip()
        except OSError as exc:
            raise OSError(f"buffer.redis_password_file: cannot read {config.redis_password_file!r}: {exc}") from None
    return options


def single_try(config: BufferConfig) -> redis.Redis:
    """A client that tries each command once: an unreachable server fails it within ``socket_timeout_s``."""
    return redis.Redis.from_url(config.redis_url, retry=Retry(NoBackoff(), 0), **_options(config))


def connect(config: BufferConfig) -> redis.Redis:
    """A client for ``buffer.redis_url`` that is known to answer, or a clear error.

    The first PING goes through a :func:`single_try` probe, so an unreachable
    server fails within ``socket_timeout_s`` instead of after the whole retry
    schedule. The returned client retries transient errors with jittered
    exponential backoff, ``buffer.retries`` times within well under a second;
    :class:`OutageWait` handles longer outages.
    """
    url = redact(config.redis_url)
    probe = single_try(config)
    try:
        probe.ping()
    except (AuthenticationError, ResponseError) as exc:  # WRONGPASS, NOAUTH, NOPERM
        raise ConnectionError(
            f"buffer.redis_url: Redis at {url} refused the connection: {exc} "
            "(check buffer.redis_username and buffer.redis_password_file)"
        ) from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise ConnectionError(
            f"buffer.redis_url: cannot reach Redis at {url} "
            f"(buffer.socket_timeout_s={config.socket_timeout_s:g}): {exc}"
        ) from None
    finally:
        probe.close()
    return redis.Redis.from_url(
        config.redis_url,
        # Short, for single blips (a pooled connection the server closed): OutageWait waits out the rest.
        retry=Retry(ExponentialWithJitterBackoff(cap=0.2, base=0.02), config.retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(config),
    )


class RedisOutage(ConnectionError):
    """Redis stayed unreachable for longer than ``buffer.outage_tolerance_s``."""


class StillDown(Exception):
    """Redis is still unreachable at a call's own deadline, within the tolerance."""


def _is_outage(error: BaseException) -> bool:
    """Errors that waiting can fix: no connection, a socket timeout, a server still loading its data.

    A refused password is a ``ConnectionError`` too, but no wait fixes it.
    """
    if isinstance(error, AuthenticationError):
        return False
    return isinstance(error, (redis.ConnectionError, redis.TimeoutError))


class OutageWait:
    """Runs one client's commands, waiting out an unreachable Redis.

    An outage starts at the first command that fails with :func:`_is_outage`
    (after redis-py's own ``buffer.retries``) and ends at the first one that
    succeeds; calls in between share it, so ``buffer.outage_tolerance_s``
    bounds the outage, not each call. Both ends are logged once. A call sleeps
    0.1 s doubling to 2 s between attempts, plus up to 0.5 s of jitter so that
    many generators do not reconnect in step, and never past its deadline or
    the tolerance; the last attempt can run over the tolerance by its own
    length (up to ``buffer.retries`` socket timeouts).

    State changes hold a lock: ``stats`` may read it from another thread.
    ``clock`` and ``sleep`` (``time.monotonic`` and ``time.sleep`` unless a
    test passes a fake clock's) time the outage and the pauses between
    attempts; a deadline ``until`` is read on the same clock.
    """

    def __init__(
        self,
        config: BufferConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.tolerance_s = config.outage_tolerance_s
        self.url = redact(config.redis_url)
        self.outages = 0  # outages seen
        self.failures = 0  # failed attempts, all outages together
        self._clock, self._sleep = clock, sleep
        self._since: float | None = None  # clock() at the current outage's first failure
        self._lock = threading.Lock()
        self._backoff = tenacity.wait_exponential(multiplier=0.1, max=2.0) + tenacity.wait_random(0, 0.5)

    @property
    def down_s(self) -> float:
        """How long the current outage has lasted; 0 while Redis answers."""
        since = self._since
        return 0.0 if since is None else self._clock() - since

    def call(self, command: Callable[[], T], until: float | None = None) -> T:
        """``command()``, attempted again while Redis is unreachable.

        Raises :class:`RedisOutage` once the outage has lasted
        ``outage_tolerance_s``, and :class:`StillDown` if the deadline
        ``until`` (on this wait's clock) comes first. ``command`` must be safe to repeat
        (a pipeline is built afresh in each attempt: ``execute`` empties it).
        """

        def last_moment() -> float:
            since = self._since if self._since is not None else self._clock()
            end = since + self.tolerance_s
            return end if until is None else min(end, until)

        result = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_outage),
            wait=lambda state: max(0.0, min(self._backoff(state), last_moment() - self._clock())),
            stop=lambda state: self._clock() >= last_moment(),
            sleep=self._sleep,
            after=self._failed,
            retry_error_callback=self._give_up,
        )(command)
        if self._since is not None:
            self._recovered()
        return result

    def _failed(self, state: tenacity.RetryCallState) -> None:
        with self._lock:
            self.failures += 1
            if self._since is not None:
                return
            self.outages += 1  # first: a reader that sees the outage's start also sees it counted
            self._since = self._clock()
        log.warning(
            "Redis at %s is unreachable (%s); waiting up to %gs (buffer.outage_tolerance_s) for it",
            self.url,
            state.outcome.exception(),
            self.tolerance_s,
        )

    def _recovered(self) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("Redis at %s is back after an outage of %.1fs", self.url, self._clock() - since)

    def _give_up(self, state: tenacity.RetryCallState) -> NoReturn:
        error = state.outcome.exception()
        since, now = self._since, self._clock()
        down_s = 0.0 if since is None else now - since
        if since is not None and now >= since + self.tolerance_s:  # the comparison call()'s stop makes
            raise RedisOutage(
                f"Redis at {self.url} has been unreachable for {down_s:.1f}s, longer than "
                f"buffer.outage_tolerance_s={self.tolerance_s:g}: {error}"
            ) from error
        raise StillDown() from error
