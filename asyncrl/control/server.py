"""The learner's control endpoint: a :class:`Coordinator` served on ``coordinator.address``.

A ROUTER socket served by one background thread (:class:`~asyncrl.wire.sockets.RequestServer`).
A generator's request for work with nothing to give yet is held for up to
``coordinator.long_poll_s``, and answered at once when a new version, a stop or
a freed slot changes the answer: the coordinator calls ``on_change``, which
wakes the server.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from asyncrl.control.coordinator import Coordinator
from asyncrl.observe import trace
from asyncrl.wire.protocol import Ack, ErrorReply, EvalReport, Message, Status, StatusRequest, WorkRequest
from asyncrl.wire.sockets import RequestServer

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.001  # the serving process's sys.setswitchinterval (version_watch_bench.py measures it)


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
        run_id: str = "",
    ) -> None:
        self.coordinator = coordinator
        self._status = status
        self.run_id = run_id  # coordinator.run_id: a generator of another run is refused
        self.foreign = 0  # work requests refused for coming from another run
        super().__init__(
            address,
            "coordinator.address",
            (WorkRequest, StatusRequest, EvalReport),
            trace.traced(self._answer),
            curve_secret_file,
            max_hold_s=max_hold_s,
            clock=coordinator.clock,
            rechecked=lambda request: not (isinstance(request, WorkRequest) and request.max_groups == 0),
        )
        coordinator.on_change = self.wake  # a new version or a stop answers held requests at once
        # A request waits for the interpreter while the learner's thread holds it, up to the switch interval
        # (5 ms by default) each time; 1 ms keeps a generator's asks short at little cost to the learner.
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def _answer(self, request: Message, final: bool = True) -> Message | None:
        if isinstance(request, WorkRequest):
            if self.run_id and request.run_id and request.run_id != self.run_id:
                self.foreign += 1
                if self.foreign == 1 or self.foreign % 100 == 0:
                    log.warning(
                        "coordinator.run_id: generator %s belongs to run %s, not to this learner's %s: refused "
                        "(%d so far; another run on this machine once used this port?)",
                        request.generator_id,
                        request.run_id,
                        self.run_id,
                        self.foreign,
                    )
                return ErrorReply(
                    reason=f"coordinator.run_id: this learner serves run {self.run_id}, not run {request.run_id} "
                    "(another run's learner on this address)"
                )
            return self.coordinator.handle_work(request, final)
        if isinstance(request, EvalReport):
            if self.coordinator.evals is None:
                raise ValueError("an evaluation report, but this run schedules no evaluations")
            self.coordinator.evals.report(request)
            return Ack()
        return self._status()
