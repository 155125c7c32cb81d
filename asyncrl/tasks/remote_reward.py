"""A reward model behind HTTP, as OpenRLHF's ``--remote_rm_url`` and verl users run one.

The contract, so that any server can sit behind it::

    POST <url>                                  (http:// or https://)
    Content-Type: application/json
    Authorization: Bearer <token>               (only with token_file)

    {"prompts":   ["12=", "12="],               the item's prompt text, as the dataset row has it
     "responses": ["12", "21"],                 the generated text, special tokens removed
     "labels":    ["12", "12"]}                 item["label"], or null when the task has none

    200 {"rewards": [0.93, -1.2]}               one number per response, same order; other keys ignored

Prompts are sent without the system prompt or chat template the policy saw:
the server formats them for its own model (``examples/reward_server.py``
applies its tokenizer's chat template when it has one). One request carries
one prompt's group of samples, or ``max_samples_per_request`` of them.
(OpenRLHF's ``serve_rm`` reads a ``query`` field holding the already
templated prompt + response instead; put a small adapter in front of it.)

Failures: a connection error, a timeout, 408, 429 or a 5xx is retried with
exponential backoff and jitter (``tenacity``), the jitter keeping many
generators from hitting a restarted server in lockstep. Any other status,
or a reply that is not ``{"rewards": [...]}`` of the right length, fails at
once: retrying a request the server rejected cannot help. What finally
fails raises :class:`RemoteRewardError`, which the generator turns into a 0
for every sample of the group and counts (``reward_failures``).

Bounds: every attempt has ``timeout_s`` (httpx's timeout of each connect,
write and read; the server sends its reply in one write, so in practice it
bounds the whole attempt), and a whole call, retries and backoff included,
ends by ``deadline_s``. The deadline matters because the generator abandons a
scorer thread that outlives ``task.reward_timeout_s``: a client that kept
retrying past it would pile up abandoned threads all hitting the server. At
most ``max_in_flight`` requests of one process are open at a time, however
many threads call (a timed-out scorer thread still holds its slot until its
own request ends, so the bound holds across them too).

Security: the bearer token is read from ``token_file`` once, at start; it
never appears in a config. Redirects are not followed (a 3xx fails the call
like any other rejection), so the token is only ever sent to the configured
host. Environment proxies (``https_proxy``, ``no_proxy``) apply, except to
loopback hosts, which are always reached directly.

Connections: one ``httpx.Client`` per reward, shared by every thread, keeps
up to ``max_in_flight`` connections alive between requests, so a server that
speaks HTTP/1.1 keep-alive is not handed a new TCP (and TLS) handshake per
group. A reply is read in a stream and refused past ``MAX_REPLY_BYTES``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlparse

from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from asyncrl.tasks.prompts import prompt_text
from asyncrl.wire.ports import is_loopback_host

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

# A longer reply is refused unread: 16 MiB is ~500k scores, far past any batch.
MAX_REPLY_BYTES = 16 * 2**20
# Statuses worth another try: the server is overloaded, restarting or behind a failing proxy.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward server gave no usable scores; the message names the URL and why."""


class _Transient(Exception):
    """An attempt failed in a way another attempt may not (connection, timeout, 429/5xx)."""


class _DeadlinePassed(Exception):
    """The call's deadline_s ran out before the next attempt."""


@runtime_checkable
class GroupReward(Protocol):
    """A reward that scores a prompt's whole group of responses in one call."""

    def score_group(self, responses: list[str], item: dict[str, Any]) -> list[float]: ...


def is_remote(reference: str | None) -> bool:
    """Whether a ``task.reward`` value (None: unset) names a reward server (an ``http://`` or ``https://`` URL)."""
    return reference is not None and reference.startswith(("http://", "https://"))


class RemoteReward:
    """Scores responses by POSTing them to a reward server; see the module docstring for the contract.

    ``RemoteReward(url)(response, item)`` scores one response;
    ``score_group(responses, item)`` scores a prompt's group in one request
    (the generator uses it when present); ``score_batch`` sends any
    prompts, responses and labels. Safe to call from several threads.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        deadline_s: float | None = None,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_in_flight: int = 8,
        max_samples_per_request: int = 0,
        token_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Check the settings and read the token; nothing is sent until the first score.

        ``url``: the server's scoring endpoint, ``http(s)://host[:port]/path``.
        ``timeout_s``: per attempt. ``deadline_s``: per call, retries
        included (None: only ``retries`` bounds it). ``retries``: attempts
        after the first. ``backoff_s``/``max_backoff_s``: the first wait
        and the cap of the doubling waits between attempts.
        ``max_in_flight``: open requests per process. ``max_samples_per_request``:
        a larger group goes in several requests (0: one request per call).
        ``token_file``: a file holding the bearer token. ``clock`` (monotonic
        seconds) and ``sleep`` time the deadline and the waits between attempts.
        """
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"remote reward: expected an http(s)://host[:port]/path URL, got {url!r}")
        if parsed.username or parsed.password:
            raise ValueError("remote reward: put the token in token_file, not in the URL")
        for name, value in (("timeout_s", timeout_s), ("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if not (math.isfinite(value) and value >= 0) or (name == "timeout_s" and value == 0):
                raise ValueError(f"remote reward: {name} must be a positive number of seconds, got {value!r}")
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"remote reward: deadline_s must be positive or None, got {deadline_s!r}")
        if retries < 0 or max_in_flight < 1 or max_samples_per_request < 0:
            raise ValueError(
                "remote reward: retries >= 0, max_in_flight >= 1 and max_samples_per_request >= 0, got "
                f"{retries}, {max_in_flight}, {max_samples_per_request}"
            )
        self.url = url
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_in_flight = max_in_flight
        self.max_samples_per_request = max_samples_per_request
        self._clock, self._sleep = clock, sleep
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Accept-Encoding": "identity",  # the reply cap counts what the server sends, never a body that inflates
        }
        if token_file is not None:
            self._headers["Authorization"] = f"Bearer {_read_token(token_file)}"
            if parsed.scheme == "http" and not is_loopback_host(parsed.hostname or ""):
                log.warning("remote reward: the bearer token goes in clear text to %s; use https://", parsed.hostname)
        # max_in_flight is kept by these slots rather than by httpx's pool: the wait for a slot comes out of the
        # deadline before the attempt's timeout is set, where a wait in the pool would leave each read its whole
        # timeout after it. The pool holds as many connections, so no request waits there.
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._client = _client(max_in_flight, direct=is_loopback_host(parsed.hostname or ""))

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"

    def close(self) -> None:
        """Close the kept-alive connections (a reward lives as long as its process, which closes them anyway)."""
        self._client.close()

    def __call__(self, response: str, item: dict[str, Any]) -> float:
        """One response's score (a group is cheaper through :meth:`score_group`)."""
        return self.score_group([response], item)[0]

    def score_group(self, responses: list[str], item: dict[str, Any]) -> list[float]:
        """Scores of a prompt's responses, in order; raises :class:`RemoteRewardError` when the server fails."""
        n = len(responses)
        return self.score_batch([prompt_text(item)] * n, list(responses), [item.get("label")] * n)

    def score_batch(self, prompts: list[str], responses: list[str], labels: list[Any]) -> list[float]:
        """Scores of ``(prompt, response, label)`` triples, split into ``max_samples_per_request`` chunks."""
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(
                f"remote reward: {len(prompts)} prompts, {len(responses)} responses, "
                f"{len(labels)} labels; expected one of each per sample"
            )
        if not responses:
            return []
        deadline = None if self.deadline_s is None else self._clock() + self.deadline_s
        step = self.max_samples_per_request or len(responses)
        scores: list[float] = []
        for start in range(0, len(responses), step):
            chunk = slice(start, start + step)
            scores += self._post_with_retries(prompts[chunk], responses[chunk], labels[chunk], deadline)
        return scores

    def _post_with_retries(
        self, prompts: list[str], responses: list[str], labels: list[Any], deadline: float | None
    ) -> list[float]:
        body = json.dumps({"prompts": prompts, "responses": responses, "labels": labels}, default=str).encode()
        backoff = wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s) + wait_random(0, self.backoff_s)

        def wait(state: RetryCallState) -> float:  # never sleep past the deadline
            return backoff(state) if deadline is None else max(0.0, min(backoff(state), deadline - self._clock()))

        failed: list[BaseException | None] = [None]  # the latest retried error, for the deadline's message
        retrying = Retrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait,
            sleep=self._sleep,
            reraise=False,
            retry=retry_if_exception_type(_Transient),
            before_sleep=lambda state: failed.__setitem__(0, state.outcome.exception()),
        )
        try:
            return retrying(self._post, body, len(responses), deadline)
        except RetryError as exc:
            why, attempts, last = "", exc.last_attempt.attempt_number, exc.last_attempt.exception()
        except _DeadlinePassed:
            why, attempts, last = (
                f" within deadline_s={self.deadline_s:g}",
                retrying.statistics["attempt_number"] - 1,
                failed[0],
            )
        raise RemoteRewardError(
            f"reward server {self.url}: no scores after {attempts} attempt(s){why}; last error: {last}"
        )

    def _remaining_s(self, deadline: float | None) -> float:
        if deadline is None:
            return self.timeout_s
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise _DeadlinePassed
        return min(self.timeout_s, remaining)

    def _post(self, body: bytes, n: int, deadline: float | None) -> list[float]:
        """One attempt: wait for a slot, POST, check the reply. Raises _Transient when worth retrying."""
        import httpx

        if not self._slots.acquire(timeout=self._remaining_s(deadline)):
            raise RemoteRewardError(
                f"reward server {self.url}: all max_in_flight={self.max_in_flight} request slots stayed busy"
            )
        try:
            timeout_s = self._remaining_s(deadline)
            with self._client.stream("POST", self.url, content=body, headers=self._headers, timeout=timeout_s) as reply:
                failed = not reply.is_success
                # an error's body is only quoted: its start is enough
                raw = _read_at_most(reply, 500 if failed else MAX_REPLY_BYTES + 1)
        except httpx.TimeoutException:
            raise _Transient(f"no reply within timeout_s={timeout_s:g}") from None
        except httpx.RequestError as exc:  # connection refused or reset, a malformed reply...
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        finally:
            self._slots.release()
        if failed:
            message = f"HTTP {reply.status_code} {reply.reason_phrase}: {raw.decode(errors='replace').strip()}"
            if reply.status_code in RETRY_STATUSES:
                raise _Transient(message)
            raise RemoteRewardError(f"reward server {self.url}: {message}")
        return self._parse(raw, n)

    def _parse(self, raw: bytes, n: int) -> list[float]:
        if len(raw) > MAX_REPLY_BYTES:
            raise RemoteRewardError(f"reward server {self.url}: reply longer than {MAX_REPLY_BYTES} bytes")
        try:
            rewards = json.loads(raw)["rewards"]
        except (ValueError, TypeError, KeyError) as exc:
            raise RemoteRewardError(
                f"reward server {self.url}: expected a JSON object with 'rewards', got "
                f"{raw[:200]!r} ({type(exc).__name__})"
            ) from None
        if (
            not isinstance(rewards, list)
            or len(rewards) != n
            or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards)
        ):
            raise RemoteRewardError(
                f"reward server {self.url}: expected 'rewards' as a list of {n} numbers, got {str(rewards)[:200]}"
            )
        return [float(r) for r in rewards]


def _client(max_in_flight: int, direct: bool) -> httpx.Client:
    """The connection pool of one reward: ``max_in_flight`` connections kept alive, redirects refused.

    ``direct`` (a loopback server): an explicit transport, which httpx then
    uses for every request instead of the environment's proxies.
    """
    import httpx  # here, not at the top: every entrypoint's --help imports this module, and httpx takes a while

    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    return httpx.Client(
        limits=limits,
        follow_redirects=False,  # a 3xx is an answer, and fails the call: the token stays with the configured host
        transport=httpx.HTTPTransport(limits=limits) if direct else None,
    )


def _read_at_most(reply: httpx.Response, limit: int) -> bytes:
    """The start of a streamed reply's body, at most ``limit`` bytes: a longer body is never read whole."""
    data = bytearray()
    for chunk in reply.iter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return bytes(data[:limit])


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"remote reward: cannot read token_file {path!r}: {exc}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"remote reward: token_file {path!r} must hold one token (no spaces)")
    return token
