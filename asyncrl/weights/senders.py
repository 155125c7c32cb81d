"""The sending side of weights: one sender per transport, and the one factory that picks it.

A sender gets each version as ``(name, tensor)`` pairs, gathered the way its
:attr:`~asyncrl.weights.transports.WeightSender.gather` asks, and announces
it through the coordinator. :func:`open_sender` switches on the transport
that :func:`~asyncrl.weights.transports.transport_of` names, as
:func:`~asyncrl.weights.transports.open_receiver` does for generators.

* :class:`FolderSender` writes an HF folder and announces it (``folder``,
  ``served``). By default (``learner.background_publish``) the learner copies
  the weights to CPU memory and trains on while a thread writes them; the
  next send first joins that thread.
* :class:`SharedSender` copies the version into one shared-memory segment
  within the step, which takes about as long as a copy of the model in
  device memory, and announces it.
* :class:`~asyncrl.weights.push_sender.PushSender` broadcasts it straight
  into the generators' engines.
* :class:`GatherOnly` is every learner rank but 0: it takes part in the
  gather, a collective, and sends nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from asyncrl.config import RunConfig
from asyncrl.observe import trace
from asyncrl.weights import folders
from asyncrl.weights.push import spec_of
from asyncrl.weights.push_sender import PushSender
from asyncrl.weights.shared import SharedSegment
from asyncrl.weights.transports import (
    Announcer,
    Gather,
    Transport,
    WeightSender,
    announce_folder,
    announce_shared,
    transport_of,
)
from asyncrl.wire.protocol import TensorSpec

# How long the next send waits for the previous version's folder to be written (a stuck disk).
WRITE_TIMEOUT_S = 600.0


class GatherOnly:
    """A learner rank other than 0: it takes part in every gather, which is collective, and sends nothing."""

    def __init__(self, transport: Transport, gather: Gather) -> None:
        self.transport, self.gather = transport, gather

    def send(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in tensors:  # each step of the gather is a collective rank 0 is in too
            pass

    def resend_if_lagging(self) -> bool:
        return False

    def timings(self) -> dict[str, float]:
        return {}

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class FolderSender:
    """Writes each version as an HF folder, then announces it by path (``folder``) or for the weight server
    (``served``).

    In the background the tensors are CPU copies taken within the step, so the next optimizer step leaves the
    version being written alone. A failed write is raised on the main thread at the next send or finish, and
    nothing unwritten is ever announced.
    """

    def __init__(
        self,
        config: RunConfig,
        model_config_json: str,
        weights_dir: Path,
        gather: Gather,
        announcer: Announcer,
        transport: Transport,
        clock: Callable[[], float] = time.monotonic,
        adapter_config_json: str | None = None,
    ) -> None:
        self.transport, self.gather = transport, gather
        self.weights_dir = weights_dir
        self._model_dir, self._config_json = config.model.path, model_config_json
        self._adapter_config_json = adapter_config_json
        self._keep_versions = config.learner.keep_versions
        self._background = config.learner.background_publish
        self._announcer, self._clock = announcer, clock
        self._writer: threading.Thread | None = None  # the version being written
        self._write_error: Exception | None = None  # set by the writer thread, raised by the main thread
        self._last_write_s: float | None = None

    def send(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self._background:
            self._write(version, tensors)
            return
        snapshot = list(tensors)  # the whole gather, now, while every rank is in it
        self._join_writer()
        writer = threading.Thread(
            target=self._write_in_background, args=(version, snapshot), name=f"publish-v{version}", daemon=True
        )
        writer.start()  # first: a thread that could not start is never joined
        self._writer = writer

    def _write(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write ``version``'s folder, then announce it."""
        started = self._clock()
        update = folders.publish(
            tensors,
            version=version,
            weights_dir=self.weights_dir,
            model_dir=self._model_dir,
            config_json=self._config_json,
            keep_versions=self._keep_versions,
            adapter_config_json=self._adapter_config_json,
        )
        self._announcer.publish(announce_folder(update, self.transport))
        self._last_write_s = self._clock() - started

    def _write_in_background(self, version: int, snapshot: list[tuple[str, torch.Tensor]]) -> None:
        try:
            with trace.span("publish_write", version=version):
                self._write(version, snapshot)
        except Exception as error:  # noqa: BLE001  (raised on the main thread, at its next send or finish)
            self._write_error = error

    def _join_writer(self) -> None:
        """Wait for the version being written; its failure is raised here, on the main thread."""
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

    def resend_if_lagging(self) -> bool:
        return False  # generators read a folder when they are ready for it

    def timings(self) -> dict[str, float]:
        return {"publish_write_s": self._last_write_s} if self._last_write_s is not None else {}

    def finish(self) -> None:
        self._join_writer()

    def close(self) -> None:
        self.finish()


class SharedSender:
    """Writes each version into one shared-memory segment on the learner's device, then announces it."""

    transport: Transport = "shared"

    def __init__(
        self,
        specs: list[TensorSpec],
        gather: Gather,
        announcer: Announcer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gather = gather
        self._specs = specs
        self._announcer, self._clock = announcer, clock
        self._segment: SharedSegment | None = None  # made at the first send, written in place at every one
        self._last_write_s: float | None = None

    def send(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        started = self._clock()
        if self._segment is None:
            self._segment = SharedSegment(self._specs, self.gather.device)
        self._segment.write(version, tensors)
        self._announcer.publish(announce_shared(version, self._segment.handle, self._segment.num_bytes))
        self._last_write_s = self._clock() - started

    def resend_if_lagging(self) -> bool:
        return False  # the segment holds the latest version for whoever reads it

    def timings(self) -> dict[str, float]:
        return {"publish_write_s": self._last_write_s} if self._last_write_s is not None else {}

    def finish(self) -> None:
        pass  # a write ends within send()

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


def gather_of(transport: Transport, config: RunConfig, model: torch.nn.Module) -> Gather:
    """How every rank gathers a version for ``transport``.

    A push is gathered in its own bucket size on this rank's GPU (else the CPU), where it is broadcast from.
    Shared weights are gathered on the device the learner trains on (a CPU learner shares a file) and may be
    the parameters themselves: each is copied into the segment before the next is asked for. Folders get CPU
    copies, which a background write may hold past the step that gathered them.
    """
    if transport == "push":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return Gather(device=device, bucket_bytes=config.push.bucket_mb * 2**20)
    if transport == "shared":
        return Gather(device=next(model.parameters()).device, copy=False)
    return Gather()


def open_sender(
    config: RunConfig,
    model: torch.nn.Module,
    weights_dir: Path,
    announcer: Announcer | None,
    clock: Callable[[], float] = time.monotonic,
) -> WeightSender:
    """The sender of the run's transport for one learner rank; ``announcer`` (the coordinator) is rank 0's alone.

    A push sender holds ``push.address`` from here on, so a port already taken is an error at start.
    """
    transport = transport_of(config)
    gather = gather_of(transport, config, model)
    if announcer is None:
        return GatherOnly(transport, gather)
    specs = [spec_of(name, p) for name, p in model.named_parameters()]  # ZeRO-3's full shapes
    if transport == "push":
        # every worker of an engine takes a whole version (vLLM's loader shards it); an adapter goes to the engine
        ranks = 1 if config.learner.lora.enabled else config.generator.vllm.tensor_parallel_size
        return PushSender(config.push, ranks, specs, gather, announcer, clock)
    if transport == "shared":
        return SharedSender(specs, gather, announcer, clock)
    return FolderSender(
        config,
        model.config.to_json_string(),
        weights_dir,
        gather,
        announcer,
        transport,
        clock,
        getattr(model, "adapter_config_json", None),  # an adapter (asyncrl.weights.adapters.AdapterView)
    )
