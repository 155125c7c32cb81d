"""The learner's control endpoint: a :class:`Coordinator` served on ``coordinator.address``.

A ROUTER socket served by one background thread (:class:`~asyncrl.wire.sockets.RequestServer`).
A generator's request for work with nothing to give yet is held for up to
``coordinator.long_poll_s``, and answered at once when a new version, a stop or
a freed slot changes the answer: the coordinator calls ``on_change``, which
wakes the server.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.control.coordinator import Coordinator
from asyncrl.observe import trace
from asyncrl.wire.protocol import Ack, EvalReport, Message, Status, StatusRequest, WorkRequest
from asyncrl.wire.sockets import RequestServer


class CoordinatorServer(RequestServer):
    """Serves a :class:`Coordinator` (and status snapshots) on ``coordinator.address``.

    Requests are held on the coordinator's own clock, so a test that drives
    the coordinator with a fake clock drives the long polls with it too.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        address: str,
        status: Callable[[], Status],
        curve_secret_file: str | None = None,
        max_hold_s: float = 1.0,
    ) -> None:
        self.coordinator = coordinator
        self._status = status
        super().__init__(
            address,
            "coordinator.address",
            (WorkRequest, StatusRequest, EvalReport),
            trace.traced(self._answer),
            curve_secret_file,
            max_hold_s=max_hold_s,
            clock=coordinator.clock,
        )
        coordinator.on_change = self.wake  # a new version or a stop answers held requests at once

    def _answer(self, request: Message, final: bool = True) -> Message | None:
        if isinstance(request, WorkRequest):
            return self.coordinator.handle_work(request, final)
        if isinstance(request, EvalReport):
            if self.coordinator.evals is None:
                raise ValueError("an evaluation report, but this run schedules no evaluations")
            self.coordinator.evals.report(request)
            return Ack()
        return self._status()
