"""A generator's weight updates: an announced version, applied through the run's receiver, all or nothing.

A failed load leaves the old version serving; it is logged, counted, and
the same version is tried again after a backoff (0.1 s doubling to 5 s,
tenacity's exponential wait). The backoff is a time to try again from, never
a sleep: mid-batch the engine goes on meanwhile, and a sleep would stall
every request in flight. A newer version is tried at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import tenacity

from asyncrl.config import RunConfig
from asyncrl.observe import trace
from asyncrl.weights.served import OtherLearner
from asyncrl.weights.shared import superseded
from asyncrl.weights.transports import WeightReceiver, open_receiver
from asyncrl.wire.protocol import WeightUpdate
from generators.base import GeneratorBackend

log = logging.getLogger(__name__)
# Shared weights: say so when this many versions in a row were overwritten before this generator copied them.
SUPERSEDED_WARN_EVERY = 10
# Between two tries of a version that failed to load: 0.1 s, doubling with each failure in a row, at most 5 s.
RETRY_WAIT = tenacity.wait_exponential(multiplier=0.1, max=5.0)
# A weight server answering for another learner than the coordinator's, this long: not the moment after a
# learner restart (its next announcement names the new session), but two runs' addresses mixed up. Fatal.
OTHER_LEARNER_FATAL_S = 30.0


class WeightUpdater:
    """Keeps a backend on the latest version the learner announces.

    ``session`` and the backend's version together say what is served
    (:attr:`WeightUpdate.identity`); ``retry_at`` is when a version that
    failed may be tried again (on ``clock``), 0.0 when none failed.
    """

    def __init__(
        self,
        config: RunConfig,
        generator_id: str,
        backend: GeneratorBackend,
        receiver: WeightReceiver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generator_id = generator_id
        self.backend = backend
        self.timeout_s = config.generator.weight_load_timeout_s
        self.receiver = receiver if receiver is not None else open_receiver(config, generator_id)
        self._clock = clock
        self.session = ""  # WeightUpdate.session of the weights served ("": the model it started with)
        self.failures = 0  # failed loads in a row
        self.failures_total = 0
        self.superseded_in_a_row = 0
        self.last_load_s: float | None = None
        self.retry_at = 0.0
        self._failed: WeightUpdate | None = None
        self._attempts = _attempts()
        self._other_learner_since: float | None = None  # when the weight server first answered for another

    def apply(self, latest: WeightUpdate | None) -> None:
        """Load ``latest`` unless it is served already or waits out its backoff; a failure is logged, not raised,
        but for a weight server that has answered for another learner for :data:`OTHER_LEARNER_FATAL_S`
        (:class:`~asyncrl.weights.served.OtherLearner`)."""
        if latest is None or not self.receiver.wants(latest, (self.session, self.backend.version)):
            return
        if latest.session == self.session and latest.version < self.backend.version:
            return  # an announcement older than the weights served (read before a later load): never go back
        started = self._clock()
        if latest == self._failed and started < self.retry_at:
            return
        try:
            with trace.span("weight_load", version=latest.version):
                self.receiver.receive(latest, self.backend, self.timeout_s)
        except Exception as exc:  # the old version keeps serving; report, back off and go on
            self._failed_to_load(latest, exc)
            return
        self.session = latest.session
        self._other_learner_since = None
        self.failures, self.retry_at, self._attempts = 0, 0.0, _attempts()
        self.superseded_in_a_row = 0
        self.last_load_s = self._clock() - started
        log.info("%s: loaded weights v%d in %.3fs", self.generator_id, self.backend.version, self.last_load_s)

    def _failed_to_load(self, latest: WeightUpdate, exc: Exception) -> None:
        if not isinstance(exc, OtherLearner):
            self._other_learner_since = None  # it must last, answer after answer, to be taken for a mix-up
        else:
            now = self._clock()
            self._other_learner_since = self._other_learner_since if self._other_learner_since is not None else now
            if now - self._other_learner_since >= OTHER_LEARNER_FATAL_S:
                raise exc
        if superseded(exc):  # shared weights: the learner wrote a newer version, announced next
            self.superseded_in_a_row += 1
            if self.superseded_in_a_row % SUPERSEDED_WARN_EVERY == 0:
                log.warning(
                    "%s: %d versions in a row were overwritten before they could be copied; still on v%d: %s",
                    self.generator_id,
                    self.superseded_in_a_row,
                    self.backend.version,
                    exc,
                )
            return
        self.failures += 1
        self.failures_total += 1
        log.error(
            "%s: loading weights v%d failed, still on v%d: %s",
            self.generator_id,
            latest.version,
            self.backend.version,
            exc,
        )
        self._failed = latest
        self._attempts.prepare_for_next_attempt()  # its attempt number is now one more than the failures
        self.retry_at = self._clock() + RETRY_WAIT(self._attempts)


def _attempts() -> tenacity.RetryCallState:
    """A count of tries for :data:`RETRY_WAIT` to read; nothing is called or slept through it."""
    return tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
