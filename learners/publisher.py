"""Weight publishing from the learner group: every rank gathers the version, rank 0's sender sends it.

Gathering ZeRO-3 shards is a collective, so every rank gathers each version
the way the run's sender asks (:attr:`~asyncrl.weights.transports.WeightSender.gather`);
how it travels on is the sender's business alone
(:func:`~asyncrl.weights.senders.open_sender` picks it from the config).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from asyncrl.config import RunConfig
from asyncrl.weights.adapters import published
from asyncrl.weights.senders import open_sender
from asyncrl.weights.transports import Announcer
from learners.engine import gathered_parameters


class Publisher:
    """Publishes each version of one learner rank's model; ``coordinator`` is set on rank 0 only."""

    def __init__(
        self,
        config: RunConfig,
        model: torch.nn.Module,
        coordinator: Announcer | None,
        weights_dir: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = published(model)  # the adapter alone when the learner trains one
        self.sender = open_sender(config, self.model, weights_dir, coordinator, clock)
        self.transport = self.sender.transport
        self._clock = clock

    def publish(self, version: int) -> float:
        """Gather the current weights and send them as version ``version``; returns the seconds it held the step."""
        started = self._clock()
        how = self.sender.gather
        self.sender.send(version, gathered_parameters(self.model, how.bucket_bytes, how.device, how.copy))
        return self._clock() - started

    def resend_if_lagging(self) -> bool:
        """Rank 0, while it waits for rollouts: send the latest version again to generators that lack it."""
        return self.sender.resend_if_lagging()

    def timings(self) -> dict[str, float]:
        """The latest completed send's seconds, as the step record names them (``push_s``, ``publish_write_s``)."""
        return self.sender.timings()

    @property
    def last_write_s(self) -> float | None:
        """Seconds the latest completed folder or segment write took."""
        return self.timings().get("publish_write_s")

    @property
    def last_push_s(self) -> float | None:
        """Seconds the latest completed push took."""
        return self.timings().get("push_s")

    def finish(self) -> None:
        """Wait for the version in flight: a folder being written, a push being sent."""
        self.sender.finish()

    def close(self) -> None:
        """Finish, then free the shared-weights segment or leave the push group, once generators stopped reading."""
        self.sender.close()
