"""The push sender: learner rank 0 announces each version as push ``<epoch>``, then broadcasts it.

With ``push.background`` (the default) rank 0 keeps the gathered copy on its
device and a thread broadcasts it while training goes on; generators join a
push at their next engine step, so the learner does not wait for them. The
cost is one model's worth of memory on rank 0. The next push first waits for
the previous one.

The thread owns the push state while it runs: it sets the failure flag,
``push_s`` and, retrying, the epoch; the main thread reads them only after
joining it (:meth:`PushSender.finish`). A push that fails or times out is
logged, not raised: generators keep the version they have, and the next push
forms a new group under the next epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import tenacity
import torch

from asyncrl.config import PushConfig
from asyncrl.weights.push import PushStats, WeightGroup, open_group
from asyncrl.weights.transports import Announcer, Gather, Transport, announce_push
from asyncrl.wire.protocol import TensorSpec

log = logging.getLogger(__name__)

Tensors = Iterable[tuple[str, torch.Tensor]]


class PushSender:
    """Sends each version over the push group, from learner rank 0 (``push.address``)."""

    transport: Transport = "push"

    def __init__(
        self,
        push: PushConfig,
        ranks_per_engine: int,
        specs: list[TensorSpec],
        gather: Gather,
        announcer: Announcer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.push, self.specs, self.gather = push, specs, gather
        self._announcer, self._clock = announcer, clock
        self._group: WeightGroup = open_group(push, 0, gather.device, ranks_per_engine)
        self._group.listen()  # holds push.address from the start (or says it is taken)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # tells the thread in flight to stop retrying; one per thread
        self._failed = False  # set by the thread, acted on by the main thread
        self._last_push_s: float | None = None
        self._retained: tuple[int, list[tuple[str, torch.Tensor]]] | None = None  # the latest version, kept
        self._repush_delay_s, self._repush_at = 2.0, 0.0
        self._lagging_since: dict[str, float] = {}  # generator id -> when it was first seen behind
        # Unique per learner start, so generators still in a previous incarnation's group re-form.
        self._epoch = int(time.time() * 1000) % 2**31

    def send(self, version: int, tensors: Tensors) -> None:
        """Announce ``push:<epoch>:<version>``, then broadcast the gathered buckets to every generator."""
        self.finish()
        self._retained = None  # the copy of the previous version goes before the next is gathered
        if self.push.background:
            tensors = list(tensors)  # the whole gather, now, while every rank is here for it
        epoch = self._epoch
        self._announce(epoch, version)
        if not self.push.background:
            self._send_now(epoch, version, tensors)
            return
        self._retained = (version, tensors)
        self._repush_delay_s, self._repush_at = 2.0, self._clock() + 2.0
        self._start_thread(epoch, version, tensors, retry=True)

    def _announce(self, epoch: int, version: int) -> None:
        """Tell generators, through the coordinator, to join push ``epoch`` of ``version``."""
        self._announcer.publish(announce_push(epoch, version, sum(s.num_bytes for s in self.specs)))

    def _start_thread(self, epoch: int, version: int, tensors: list, retry: bool) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._send_in_background,
            name=f"push-v{version}",
            daemon=True,
            args=(epoch, version, tensors, retry, self._group, self._stop),
        )
        self._thread.start()

    def _send_now(self, epoch: int, version: int, tensors: Tensors) -> None:
        """The foreground push: one attempt; after a failure the next version goes out under a new epoch."""
        try:
            self._attempt(self._group, epoch, version, tensors)
        except Exception:  # noqa: BLE001  (a failed push must not stop training; _attempt logged it)
            for _ in tensors:  # other ranks may still be in the gather's collectives
                pass
            self._next_epoch()

    def _send_in_background(
        self, epoch: int, version: int, tensors: list, retry: bool, group: WeightGroup, stop: threading.Event
    ) -> None:
        """The push thread: a failed push is announced again under the next epoch and retried, with backoff,
        until it lands or a newer version replaces it (``stop``).

        A generator that restarted, or that missed the push, therefore gets the current weights without
        waiting for the next training step. Without ``retry`` it is one attempt: a re-push for generators
        left behind, whose pace :meth:`resend_if_lagging` sets.
        """
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Exception),
            stop=tenacity.stop_when_event_set(stop) if retry else tenacity.stop_after_attempt(1),
            wait=tenacity.wait_exponential(multiplier=1.0, max=self.push.timeout_s),  # 1, 2, 4 ... s
            sleep=stop.wait,  # a newer version due, or the end of the run, cuts the wait short
            retry_error_callback=lambda state: None,  # given up: generators keep the version they have
        )
        for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    if stop.is_set():
                        return
                    epoch = self._epoch = epoch + 1  # this thread owns the epoch until it is joined
                    self._announce(epoch, version)
                self._attempt(group, epoch, version, tensors)

    def _attempt(self, group: WeightGroup, epoch: int, version: int, tensors: Tensors) -> PushStats:
        """One broadcast of ``version`` in group ``epoch``; a failure is logged and flagged, then raised."""
        try:
            stats = group.send(epoch, version, self.specs, iter(tensors), self.gather.bucket_bytes)
        except Exception as error:
            log.error("weight push v%d (epoch %d) failed, generators keep their version: %s", version, epoch, error)
            self._failed = True
            raise
        log.info(
            "pushed v%d: %.1f MB in %d buckets, %.3f s",
            stats.version,
            stats.num_bytes / 1e6,
            stats.num_buckets,
            stats.seconds,
        )
        self._last_push_s = stats.seconds  # the latest completed push, for the metrics
        self._failed = False
        return stats

    def resend_if_lagging(self) -> bool:
        """While rank 0 waits for rollouts: push the latest version again if a generator lacks it.

        A generator that started, or restarted, after a push cannot get work
        until it holds the latest version, and no new version comes while no
        work is done. This breaks that wait. It re-sends the copy kept from the
        last push, under a new epoch (a new group) that every generator joins,
        with backoff so that a generator that keeps failing does not keep the
        others busy. Rank 0 alone: no other rank is involved.
        """
        if self._retained is None:
            return False
        if self._thread is not None and self._thread.is_alive():
            return True
        now = self._clock()
        lagging = self._announcer.lagging()
        # Just after a push, generators report the new version at their next request: only a
        # generator that stays behind for a while has missed it.
        self._lagging_since = {g: self._lagging_since.get(g, now) for g in lagging}
        lagging = [g for g, since in self._lagging_since.items() if now - since >= 2.0]
        if not lagging or now < self._repush_at:
            return bool(self._lagging_since)
        self.finish()
        self._epoch += 1
        version, tensors = self._retained
        log.warning("generators %s lack v%d: pushing it again (epoch %d)", ", ".join(lagging), version, self._epoch)
        self._announce(self._epoch, version)
        self._start_thread(self._epoch, version, tensors, retry=False)  # the pace of re-pushes is set here
        # Backoff: 2, 4, 8 ... s between re-pushes, up to 5 minutes, so a generator that keeps failing
        # does not hold the others in a push every few seconds.
        self._repush_at = self._clock() + self._repush_delay_s
        self._repush_delay_s = min(2 * self._repush_delay_s, 300.0)
        return True

    def timings(self) -> dict[str, float]:
        return {"push_s": self._last_push_s} if self._last_push_s is not None else {}

    def _next_epoch(self) -> None:
        self._failed = False
        self._epoch += 1

    def finish(self) -> None:
        """Stop retrying and wait for the push in flight, if any; a push stuck past its time is aborted."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        limit_s = self.push.timeout_s * 4  # join, manifest, buckets: each wait has push.timeout_s
        thread.join(timeout=limit_s)
        if thread.is_alive():
            log.error("weight push %s still running after %.0f s; aborting it", thread.name, limit_s)
            self._group = self._group.successor()
            self._failed = True
        if self._failed:
            self._next_epoch()

    def close(self) -> None:
        """Finish, then leave the push group."""
        self.finish()
        self._group.close()
