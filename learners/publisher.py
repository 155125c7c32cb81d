"""Weight publishing from the learner group: HF folders, or a push straight into the generators' engines.

Every rank takes part in gathering the ZeRO-3 shards (the gather is a
collective); rank 0, which holds the coordinator, announces and sends.
The push state lives here, shared by the main thread and one push thread:
the thread sets ``_push_failed`` and ``last_push_s``, the main thread acts
on them only after joining it (:meth:`Publisher.finish`). A folder version
is written the same way by default (``learner.background_publish``): the
main thread copies the weights to CPU memory and trains on while a writer
thread saves and announces them; the next publish first joins it. With
``shared`` weights (one machine), rank 0 copies the version into its
shared-memory segment within the step, which takes about as long as a copy
of the model in device memory, and announces it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from asyncrl.config import RunConfig
from asyncrl.control.coordinator import Coordinator
from asyncrl.observe import trace
from asyncrl.weights import folders
from asyncrl.weights.push import WeightGroup, open_group, spec_of
from asyncrl.weights.shared import SharedSegment
from asyncrl.weights.transports import announce_folder, announce_push, announce_shared, transport_of
from learners.engine import gathered_parameters

log = logging.getLogger(__name__)
# How long the next publish waits for the previous version's folder to be written (a stuck disk).
WRITE_TIMEOUT_S = 600.0


def _push_device() -> torch.device:
    """Where a pushed version is gathered and broadcast from: this rank's GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Publisher:
    """Publishes each version of one learner rank's model; ``coordinator`` is set on rank 0 only."""

    def __init__(
        self, config: RunConfig, model: torch.nn.Module, coordinator: Coordinator | None, weights_dir: Path
    ) -> None:
        self.config = config
        self.model = model
        self.coordinator = coordinator
        self.weights_dir = weights_dir
        self._model_config_json = model.config.to_json_string()
        self.transport = transport_of(config)
        self._push_group: WeightGroup | None = None
        self._push_thread: threading.Thread | None = None
        self._push_failed = False  # set by the push thread, acted on by the main thread
        self._push_stop = threading.Event()  # tells the push thread in flight to stop retrying; one per thread
        self.last_push_s: float | None = None
        self._retained = None  # rank 0, background push: (version, specs, tensors) of the latest version
        self._repush_delay_s, self._repush_at = 2.0, 0.0
        self._lagging_since: dict[str, float] = {}  # generator id -> when it was first seen behind
        # Unique per learner start, so generators still in a previous incarnation's group re-form.
        self._push_epoch = int(time.time() * 1000) % 2**31
        self._writer: threading.Thread | None = None  # rank 0: the folder version being written
        self._write_error: Exception | None = None  # set by the writer thread, raised by the main thread
        self.last_write_s: float | None = None  # seconds the latest completed folder write took
        self._segment: SharedSegment | None = None  # rank 0, shared weights: written in place each version
        if self.transport == "push" and coordinator is not None:
            self._push_group = open_group(config.push, 0, _push_device(), config.generator.vllm.tensor_parallel_size)
            self._push_group.listen()  # holds push.address from the start (or says it is taken)

    def publish(self, version: int) -> float:
        """Export the current weights as version ``version``; returns seconds taken.

        Every rank gathers (the gather is collective); rank 0 writes and announces,
        or announces and pushes when ``push.address`` is set.
        """
        started = time.monotonic()
        if self.transport == "push":
            self._push(version)
            return time.monotonic() - started
        if self.transport == "shared":
            self._write_shared(version)
            return time.monotonic() - started
        tensors = gathered_parameters(self.model)
        if self.coordinator is None:
            for _ in tensors:
                pass
            return time.monotonic() - started
        if not self.config.learner.background_publish:
            self._write(version, tensors)
            return time.monotonic() - started
        # The whole gather, now: its tensors are CPU copies, which the next optimizer step leaves alone.
        snapshot = list(tensors)
        self._join_writer()
        self._writer = threading.Thread(
            target=self._write_in_background, args=(version, snapshot), name=f"publish-v{version}", daemon=True
        )
        self._writer.start()
        return time.monotonic() - started

    def _write_shared(self, version: int) -> None:
        """Copy the weights into the segment on this rank's device, then announce them (rank 0 writes)."""
        device = next(self.model.parameters()).device  # where the learner trains: a CPU learner shares a file
        tensors = gathered_parameters(self.model, device=device, copy=False)
        if self.coordinator is None:
            for _ in tensors:
                pass
            return
        started = time.monotonic()
        if self._segment is None:
            self._segment = SharedSegment([spec_of(name, p) for name, p in self.model.named_parameters()], device)
        self._segment.write(version, tensors)
        self.coordinator.publish(announce_shared(version, self._segment.handle, self._segment.num_bytes))
        self.last_write_s = time.monotonic() - started

    def _write(self, version: int, tensors) -> None:
        """Write ``version``'s folder and announce it (rank 0)."""
        started = time.monotonic()
        update = folders.publish(
            tensors,
            version=version,
            weights_dir=self.weights_dir,
            model_dir=self.config.model.path,
            config_json=self._model_config_json,
            keep_versions=self.config.learner.keep_versions,
        )
        self.coordinator.publish(announce_folder(update, self.transport))
        self.last_write_s = time.monotonic() - started

    def _write_in_background(self, version: int, snapshot) -> None:
        try:
            with trace.span("publish_write", version=version):
                self._write(version, snapshot)
        except Exception as error:  # noqa: BLE001  (raised on the main thread, at its next publish or finish)
            self._write_error = error

    def _join_writer(self) -> None:
        """Wait for the folder version being written; its failure is raised here, on the main thread."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join(timeout=WRITE_TIMEOUT_S)
            if writer.is_alive():
                raise TimeoutError(
                    f"writing weights {writer.name} to {self.weights_dir} took over {WRITE_TIMEOUT_S:.0f} s"
                )
        error, self._write_error = self._write_error, None
        if error is not None:
            raise RuntimeError(f"publishing weights to {self.weights_dir} failed: {error}") from error

    def _push(self, version: int) -> None:
        """Announce ``push:<epoch>:<version>``, then broadcast the gathered buckets to every generator.

        Every rank takes part in the gather. With ``push.background`` (the
        default), rank 0 keeps the gathered copy on its device and a thread
        broadcasts it while training goes on. Generators join a push at their
        next engine step, so the learner does not wait for them. The cost is
        one model's worth of memory on rank 0. The next push first waits for
        the previous one.

        A push that fails or times out is logged, not raised: generators keep
        the version they have, and the next push forms a new group (next epoch).
        """
        push = self.config.push
        bucket_bytes = push.bucket_mb * 2**20
        device = _push_device()
        tensors = gathered_parameters(self.model, bucket_bytes, device)
        if self.coordinator is None:
            for _ in tensors:
                pass
            return
        self.finish()
        self._retained = None  # the copy of the previous version goes before the next is gathered
        specs = [spec_of(name, p) for name, p in self.model.named_parameters()]
        if push.background:
            tensors = list(tensors)  # the whole gather, now, while every rank is here for it
        epoch = self._push_epoch
        self._announce_push(epoch, version, specs)
        if push.background:
            self._retained = (version, specs, tensors)
            self._repush_delay_s, self._repush_at = 2.0, time.monotonic() + 2.0
            self._start_push_thread(epoch, version, specs, tensors, bucket_bytes, retry=True)
        else:
            self._send(
                epoch,
                version,
                specs,
                tensors,
                bucket_bytes,
                background=False,
                retry=False,
                group=self._push_group,
                stop=self._push_stop,
            )

    def _announce_push(self, epoch: int, version: int, specs) -> None:
        """Tell generators, through the coordinator, to join push ``epoch`` of ``version``."""
        self.coordinator.publish(announce_push(epoch, version, sum(s.num_bytes for s in specs)))

    def _start_push_thread(self, epoch: int, version: int, specs, tensors, bucket_bytes: int, retry: bool) -> None:
        self._push_stop = threading.Event()
        self._push_thread = threading.Thread(
            target=self._send,
            name=f"push-v{version}",
            daemon=True,
            args=(epoch, version, specs, tensors, bucket_bytes),
            kwargs=dict(background=True, retry=retry, group=self._push_group, stop=self._push_stop),
        )
        self._push_thread.start()

    def repush_if_lagging(self) -> bool:
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
        if self._push_thread is not None and self._push_thread.is_alive():
            return True
        now = time.monotonic()
        lagging = self.coordinator.lagging()
        # Just after a push, generators report the new version at their next request: only a
        # generator that stays behind for a while has missed it.
        self._lagging_since = {g: self._lagging_since.get(g, now) for g in lagging}
        lagging = [g for g, since in self._lagging_since.items() if now - since >= 2.0]
        if not lagging or now < self._repush_at:
            return bool(self._lagging_since)
        self.finish()
        self._push_epoch += 1
        version, specs, tensors = self._retained
        log.warning(
            "generators %s lack v%d: pushing it again (epoch %d)", ", ".join(lagging), version, self._push_epoch
        )
        self._announce_push(self._push_epoch, version, specs)
        self._start_push_thread(
            self._push_epoch, version, specs, tensors, self.config.push.bucket_mb * 2**20, retry=False
        )  # the pace of re-pushes is set here, with backoff
        self._repush_at = time.monotonic() + self._repush_delay_s
        self._repush_delay_s = min(2 * self._repush_delay_s, 300.0)
        return True

    def _send(
        self,
        epoch: int,
        version: int,
        specs,
        tensors,
        bucket_bytes: int,
        *,
        background: bool,
        retry: bool,
        group: WeightGroup,
        stop: threading.Event,
    ) -> None:
        """Send one version.

        In the background, a failed push is announced again under the next
        epoch and retried, with backoff, until it lands or a newer version
        replaces it. A generator that restarted, or that missed the push,
        therefore gets the current weights without waiting for the next
        training step. In the foreground there is no retry: the next version
        goes out under a new epoch.
        """
        delay_s = 1.0
        while True:
            try:
                stats = group.send(epoch, version, specs, iter(tensors), bucket_bytes)
            except Exception as error:  # noqa: BLE001  (a failed push must not stop training)
                log.error("weight push v%d (epoch %d) failed, generators keep their version: %s", version, epoch, error)
                self._push_failed = True
                if not background:
                    for _ in tensors:  # other ranks may still be in the gather's collectives
                        pass
                    self._next_push_epoch()
                    return
                if not retry or stop.wait(delay_s):
                    return  # a single attempt, a newer version is due, or the run is over
                delay_s = min(2 * delay_s, self.config.push.timeout_s)
                epoch = self._push_epoch = epoch + 1  # this thread owns the epoch until it is joined
                self._announce_push(epoch, version, specs)
                continue
            log.info(
                "pushed v%d: %.1f MB in %d buckets, %.3f s",
                stats.version,
                stats.num_bytes / 1e6,
                stats.num_buckets,
                stats.seconds,
            )
            self.last_push_s = stats.seconds  # the latest completed push, for the metrics
            self._push_failed = False
            return

    def _next_push_epoch(self) -> None:
        self._push_failed = False
        self._push_epoch += 1

    def close(self) -> None:
        """Finish what is in flight, then free the shared-weights segment and leave the push group; call it
        once generators have stopped reading."""
        self.finish()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if self._push_group is not None:
            self._push_group.close()
            self._push_group = None

    def finish(self) -> None:
        """Wait for the folder version being written, and stop retrying and wait for the push in flight,
        if any; a push stuck past its time is aborted."""
        self._join_writer()
        thread, self._push_thread = self._push_thread, None
        if thread is None:
            return
        self._push_stop.set()
        limit_s = self.config.push.timeout_s * 4  # join, manifest, buckets: each wait has push.timeout_s
        thread.join(timeout=limit_s)
        if thread.is_alive():
            log.error("weight push %s still running after %.0f s; aborting it", thread.name, limit_s)
            self._push_group = self._push_group.successor()
            self._push_failed = True
        if self._push_failed:
            self._next_push_epoch()
