"""How a published version travels from the learner to the generators: one interface, four transports.

* ``folder``: the learner writes an HF folder (atomic rename) and announces
  its path; generators on the same machine, or on a file system every host
  mounts, read it in place.
* ``served``: the same folder, served by the learner over ZeroMQ
  (``coordinator.weights_address``); each generator fetches a local copy
  first (:mod:`asyncrl.weights.served`).
* ``push``: no folder at all; learner rank 0 broadcasts the gathered tensors
  over a process group, NCCL between GPUs and gloo on CPU, straight into the
  engines (``push.address``, :mod:`asyncrl.weights.push`).
* ``shared``: learner and generators on one machine, on the same GPU or on
  CPU: the learner writes each version into one shared-memory segment (CUDA
  IPC on a GPU, a ``/dev/shm`` file on CPU) and generators copy it from there
  (``learner.shared_weights``, :mod:`asyncrl.weights.shared`). No disk and no
  process group, which NCCL refuses between two ranks of one GPU.

:func:`transport_of` is the only place that chooses one, from the config;
the announcement (:class:`~asyncrl.wire.protocol.WeightUpdate`) names it, and a
generator configured for another transport refuses it with a clear error
rather than guessing. Every receiver verifies before anything changes in
the engine and loads all or nothing: a failed receive leaves the version
that was serving.

Each side has one interface here: :class:`WeightSender` on the learner,
made by :func:`asyncrl.weights.senders.open_sender`, and
:class:`WeightReceiver` on the generators, made by :func:`open_receiver`.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol
from urllib.parse import unquote, urlparse

import msgspec

from asyncrl.config import RunConfig
from asyncrl.weights import folders
from asyncrl.weights.folders import ADAPTER_CONFIG, ADAPTER_FILE
from asyncrl.wire.protocol import SharedHandle, WeightUpdate, now_s

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Transport = Literal["folder", "served", "push", "shared"]


def transport_of(config: RunConfig) -> Transport:
    """The transport a run uses: push when ``push.address`` is set, served with a weights address, shared
    where ``learner.shared_weights`` says so (:meth:`~asyncrl.config.RunConfig.shares_weights`), else folders."""
    if config.push.address:
        return "push"
    if config.coordinator.weights_address:
        return "served"
    if config.shares_weights():
        return "shared"
    return "folder"


# --- the learner side: announce and send ------------------------------------------------------


def announce_folder(written: WeightUpdate, transport: Transport) -> WeightUpdate:
    """The announcement of a folder :func:`asyncrl.weights.folders.publish` wrote, for ``folder`` or ``served``."""
    if transport == "served":
        return msgspec.structs.replace(written, transport="served", uri="")
    return msgspec.structs.replace(written, transport="folder")


def announce_push(epoch: int, version: int, num_bytes: int) -> WeightUpdate:
    """The announcement of push ``epoch``: every generator joins that group to receive ``version``."""
    return WeightUpdate(version=version, transport="push", epoch=epoch, num_bytes=num_bytes, published_s=now_s())


def announce_shared(version: int, handle: SharedHandle, num_bytes: int) -> WeightUpdate:
    """The announcement of ``version``, written into the segment ``handle`` opens."""
    return WeightUpdate(version=version, transport="shared", shared=handle, num_bytes=num_bytes, published_s=now_s())


class Announcer(Protocol):
    """Where a sender tells generators of a version: the coordinator, on learner rank 0."""

    def publish(self, update: WeightUpdate) -> None:
        """Hand ``update`` to every generator at its next request."""
        ...

    def lagging(self) -> list[str]:
        """The generators that report a version older than the latest announced."""
        ...


@dataclass(frozen=True)
class Gather:
    """How the learner gathers a version for its sender: onto which device, in buckets of how many bytes.

    ``copy=False`` lets a tensor already on ``device`` come as the parameter itself. That is safe only for a
    sender that is done with each tensor before the next is asked for, and before training goes on.
    """

    device: torch.device | str = "cpu"
    bucket_bytes: int = 256 * 2**20
    copy: bool = True


class WeightSender(Protocol):
    """Sends each version the learner publishes to the generators, by the run's one transport.

    Every learner rank has one, because gathering a ZeRO-3 version is a collective: rank 0's sender announces
    and sends, the other ranks' only take part in the gather (:class:`~asyncrl.weights.senders.GatherOnly`).
    """

    transport: Transport
    gather: Gather  # how the learner gathers the tensors it passes to send()

    def send(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Announce and send ``version``, or start to on a thread; ``tensors`` is consumed whole on every rank."""
        ...

    def resend_if_lagging(self) -> bool:
        """While the learner waits for rollouts: send the latest version again to generators that lack it.

        Returns whether a generator lacks it; a transport that generators read from at will returns False.
        """
        ...

    def timings(self) -> dict[str, float]:
        """Seconds the latest completed send took, under the step record's names (``push_s``,
        ``publish_write_s``); empty before one completed."""
        ...

    def finish(self) -> None:
        """Wait for the send in flight; a folder that could not be written is raised here, a push is logged."""
        ...

    def close(self) -> None:
        """Finish, then free what the sender holds (a segment, a push group), once generators stopped reading."""
        ...


# --- the generator side: receive and verify -----------------------------------------------------


class Loadable(Protocol):
    """What a generator backend offers a receiver."""

    version: int

    def load_folder(self, folder: Path, version: int, timeout_s: float) -> None:
        """Verify the HF folder and switch to it entirely, or raise and keep serving."""
        ...

    def receive_push(self, epoch: int, version: int, timeout_s: float) -> None:
        """Join push ``epoch`` and switch to what arrives entirely, or raise and keep serving."""
        ...

    def load_shared(self, handle: SharedHandle, version: int, timeout_s: float) -> None:
        """Copy ``version`` out of the learner's segment and switch to it entirely, or raise and keep serving."""
        ...


class WeightReceiver(Protocol):
    """Takes announced versions into a backend."""

    transport: Transport

    def wants(self, update: WeightUpdate, serving: tuple[str, int]) -> bool:
        """Whether to act on ``update`` while the backend serves ``serving`` (a :attr:`WeightUpdate.identity`)."""
        ...

    def receive(self, update: WeightUpdate, backend: Loadable, timeout_s: float) -> None:
        """Load ``update`` into ``backend``, all or nothing."""
        ...


def _check_transport(update: WeightUpdate, mine: Transport) -> None:
    if update.transport != mine:
        raise ValueError(
            f"weights v{update.version} travel by {update.transport!r} but this generator is set up for {mine!r}: "
            "give every process of the run the same push.address and coordinator.weights_address"
        )


def folder_of(update: WeightUpdate) -> Path:
    """The local folder of a ``folder`` announcement, verified to hold a complete version."""
    parsed = urlparse(update.uri)
    if parsed.scheme != "file":
        raise ValueError(f"weights v{update.version}: expected a file:// folder, got {update.uri!r}")
    folder = Path(unquote(parsed.path))  # as_uri() escapes "=", spaces, "%"...
    adapter = (folder / ADAPTER_CONFIG).exists()  # a LoRA learner's version: a PEFT adapter folder
    for name in (ADAPTER_CONFIG, ADAPTER_FILE) if adapter else ("config.json", "model.safetensors"):
        if not (folder / name).exists():
            raise FileNotFoundError(f"weights v{update.version}: {folder / name} is missing (pruned or never written)")
    return folder


class FolderReceiver:
    """Reads each new version in place from the folder the learner announced."""

    transport: Transport = "folder"

    def wants(self, update: WeightUpdate, serving: tuple[str, int]) -> bool:
        return update.identity != serving

    def receive(self, update: WeightUpdate, backend: Loadable, timeout_s: float) -> None:
        _check_transport(update, self.transport)
        backend.load_folder(folder_of(update), update.version, timeout_s)


class ServedReceiver:
    """Fetches each new version from the learner's weight server into a local cache, then loads that."""

    transport: Transport = "served"

    def __init__(self, address: str, cache_dir: Path, curve_secret_file: str | None) -> None:
        self.address, self.cache_dir, self.curve_secret_file = address, cache_dir, curve_secret_file
        self.held: int | None = None  # the version whose fetched folder is serving: deltas start from it

    def wants(self, update: WeightUpdate, serving: tuple[str, int]) -> bool:
        return update.identity != serving

    def receive(self, update: WeightUpdate, backend: Loadable, timeout_s: float) -> None:
        from asyncrl.weights.served import OtherLearner, fetch

        _check_transport(update, self.transport)
        session = update.session
        try:
            folder = fetch(
                update.version, self.address, self.cache_dir, timeout_s, self.curve_secret_file, self.held, session
            )
        except (TimeoutError, FileNotFoundError, OtherLearner):  # silence, refusal, another learner: not the delta
            raise
        except Exception as exc:  # noqa: BLE001  (a delta that did not apply: the whole file instead, once)
            if self.held is None:
                raise
            log.warning(
                "weights v%d: the delta from v%d failed (%s); fetching the whole version",
                update.version,
                self.held,
                exc,
            )
            self.held = None  # the held folder is no base to build on until a whole version replaces it
            folder = fetch(
                update.version, self.address, self.cache_dir, timeout_s, self.curve_secret_file, session=session
            )
        backend.load_folder(folder, update.version, timeout_s)
        self.held = update.version


class PushReceiver:
    """Joins each announced push once.

    A push is a broadcast every member must join, even one that holds the
    version already (the learner pushes again for a generator that missed
    it), so what counts is the epoch, not the version; after one try, failed
    or not, the generator waits for the next announcement.
    """

    transport: Transport = "push"

    def __init__(self) -> None:
        self._tried: tuple[str, int, int] | None = None

    def wants(self, update: WeightUpdate, serving: tuple[str, int]) -> bool:
        return (update.session, update.epoch, update.version) != self._tried

    def receive(self, update: WeightUpdate, backend: Loadable, timeout_s: float) -> None:
        _check_transport(update, self.transport)
        self._tried = (update.session, update.epoch, update.version)
        backend.receive_push(update.epoch, update.version, timeout_s)


class SharedReceiver:
    """Copies each new version out of the learner's shared-memory segment."""

    transport: Transport = "shared"

    def wants(self, update: WeightUpdate, serving: tuple[str, int]) -> bool:
        return update.identity != serving

    def receive(self, update: WeightUpdate, backend: Loadable, timeout_s: float) -> None:
        _check_transport(update, self.transport)
        if update.shared is None:
            raise ValueError(f"weights v{update.version}: a shared announcement without its segment handle")
        backend.load_shared(update.shared, update.version, timeout_s)


def open_receiver(config: RunConfig, generator_id: str) -> WeightReceiver:
    """The receiver for the run's transport (:func:`transport_of`)."""
    transport = transport_of(config)
    if transport == "push":
        return PushReceiver()
    if transport == "shared":
        return SharedReceiver()
    if transport == "served":
        # Fetched versions are this process's own: removed at exit, or by the next generator here if killed.
        prefix = f"asyncrl-fetched-{generator_id}-"
        folders.sweep_private_folders(Path(tempfile.gettempdir()), prefix)
        cache = folders.private_folder(Path(tempfile.gettempdir()), prefix)
        atexit.register(shutil.rmtree, cache, True)
        return ServedReceiver(config.coordinator.weights_address, cache, config.coordinator.curve_secret_file)
    return FolderReceiver()
