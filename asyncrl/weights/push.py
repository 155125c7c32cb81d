"""Weight push over a process group: learner rank 0 broadcasts, every generator engine receives.

Nothing touches the disk, and on GPU nothing passes through host memory: the
learner's gathered buckets go from its GPU straight into the generators' GPUs
with NCCL. On CPU the same code runs over gloo, which is how the tests cover it.

One push:

1. The sender broadcasts a manifest: the version, the bucket size, and each
   tensor's name, dtype and shape, in order (msgspec bytes).
2. Then it broadcasts one flat ``uint8`` bucket at a time, packed in manifest
   order, while the next bucket is being packed (two buffers).
3. Receivers unpack every bucket into views that they keep.

A receiver returns nothing until the last bucket has arrived, and it validates
the manifest against the model before loading anything. A push that breaks or
times out therefore leaves the engine serving its previous version. The price
is one model's worth of staging memory on the receiver while a push lands.

vLLM ships NCCL weight-transfer helpers too. They are not used here because
they are CUDA-only (no CPU path to test) and they load each bucket as it lands,
so a push that breaks half-way leaves a half-updated model.

The group is formed once, at the first push, by a rendezvous on a TCPStore
that the sender hosts. It is then reused for every version. After a failed
push both sides drop the group, and the next push forms a new one under the
next *epoch*. The epoch travels in the announcement
(:class:`~asyncrl.wire.protocol.WeightUpdate`), so a receiver always knows which group to join.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import msgspec
import torch
import torch.distributed as dist

from asyncrl.config import read_secret
from asyncrl.wire.protocol import Manifest, TensorSpec

log = logging.getLogger(__name__)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The full (unpartitioned) spec of a parameter; ZeRO-3 keeps the real shape in ``ds_shape``."""
    shape = tensor.ds_shape if hasattr(tensor, "ds_shape") else tensor.shape
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(int(d) for d in shape))


ALIGN = 16  # every tensor starts at a multiple of this in its bucket, so any dtype can view it


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


def layout(specs: list[TensorSpec], bucket: list[int]) -> tuple[list[int], int]:
    """Byte offsets of a bucket's tensors, and the bucket's size."""
    offsets, size = [], 0
    for i in bucket:
        offsets.append(size)
        size += _aligned(specs[i].num_bytes)
    return offsets, size


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Split tensor indices into consecutive buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        if current and size + _aligned(spec.num_bytes) > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += _aligned(spec.num_bytes)
    if current:
        buckets.append(current)
    return buckets


@dataclass
class PushStats:
    """What :meth:`WeightGroup.send` reports of one push: the tensors' bytes, how many buckets carried them,
    and the wall-clock seconds the send took, joining the group included."""

    version: int
    num_bytes: int
    num_buckets: int
    seconds: float


class WeightGroup:
    """One member of the push group: rank 0 sends, ranks 1.. receive.

    ``address`` is ``host:port`` of the rendezvous store, which rank 0 hosts.
    ``backend`` is ``nccl`` (tensors on ``device``, a CUDA device) or ``gloo``
    (CPU tensors). ``secret`` prefixes every rendezvous key, so a peer has to
    know it to join. NCCL's own bootstrap is not authenticated: off loopback,
    run the group on a trusted network.
    """

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        device: str | torch.device = "cpu",
        secret: str = "",
    ) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"weight push address: expected HOST:PORT, got {address!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight push rank {rank} is outside a group of {world_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight push backend: expected nccl or gloo, got {backend!r}")
        self.host, self.port = host, int(port)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        self.secret = secret
        self.epoch = -1
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None

    # --- membership ---------------------------------------------------------------------------

    def listen(self) -> None:
        """Sender: host the store on ``address`` now, and keep its port for the life of this group.

        The learner listens from its start, before any generator starts, so no
        other process can be handed the port in between. A port that is taken
        already is an error naming ``push.address``, where a push that found it
        taken later would fail and be retried for ever.
        """
        if self.rank != 0 or self._store is not None:
            return
        try:
            self._store = dist.TCPStore(
                self.host, self.port, self.world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
            )
        except (RuntimeError, OSError) as error:
            raise ValueError(
                f"push.address {self.host}:{self.port}: the learner cannot listen there ({str(error).splitlines()[0]})"
            ) from error

    def join(self, epoch: int) -> None:
        """Form (or re-form) the group for ``epoch``; returns once every member has joined."""
        if self._group is not None and epoch == self.epoch:
            return
        try:
            self._join(epoch)
        except Exception as error:
            redacted = self._redacted(error)
            if redacted is error:
                raise
            raise redacted from None  # the original, in the context, would print the secret all the same

    def _redacted(self, error: Exception) -> Exception:
        """``error`` without the secret: torch's store errors name the keys they waited for, which start
        with it, and errors end up in logs that others may read."""
        if not self.secret or self.secret not in str(error):
            return error
        text = str(error).replace(self.secret, "<push.secret_file>")
        try:
            return type(error)(text)
        except Exception:  # an exception type that takes other arguments
            return RuntimeError(text)

    def _join(self, epoch: int) -> None:
        self.leave()
        if self.rank == 0:
            self.listen()  # the sender hosts the store and keeps it, so re-forming needs no new port
        else:  # receivers reconnect every time, in case the sender restarted
            self._store = dist.TCPStore(
                self.host, self.port, self.world_size, is_master=False, timeout=self.timeout, wait_for_workers=False
            )
        store = dist.PrefixStore(f"asyncrl-push/{self.secret}/{epoch}", self._store)
        self._wait_for_members(store, epoch)
        if self.backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        else:
            # NCCL's watchdog ends the process when a collective outlives the group's timeout;
            # ours (in _wait) must fire first, so that a timeout is an error, not a crash.
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout * 4
            self._group = dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        self.epoch = epoch
        log.info(
            "weight push group epoch %d formed: rank %d of %d (%s)", epoch, self.rank, self.world_size, self.backend
        )

    def _wait_for_members(self, store: dist.Store, epoch: int) -> None:
        """Count in on the store and wait, up to the timeout, until every member has.

        NCCL connects lazily, at the first collective, and waits for missing
        members there without a limit; this wait puts one on forming the group.
        """
        if store.add("members", 1) > self.world_size:
            raise TimeoutError(f"weight push group epoch {epoch} formed without this member; it joins the next push")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (present := store.add("members", 0)) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"weight push group epoch {epoch}: {present} of {self.world_size} members "
                    f"joined within {self.timeout.total_seconds():.0f} s"
                )
            time.sleep(0.01)

    def leave(self) -> None:
        """Drop the group (after a failure, or at shutdown); the next push forms a new one."""
        group, self._group = self._group, None
        if group is not None and self.backend == "nccl":
            try:
                group.abort()  # frees the communicator even when a peer is gone
            except Exception as error:  # already torn down by NCCL's watchdog
                log.debug("weight push group abort: %s", error)

    def close(self) -> None:
        self.leave()
        self._store = None

    def successor(self) -> WeightGroup:
        """A fresh member on the same store, for when this one is stuck in a push another thread runs.

        Aborts this member's group so that the stuck push fails, and hands the
        store (and its port) over, so that the next push does not find the
        address taken.
        """
        self.leave()
        fresh = copy.copy(self)
        fresh._group, fresh.epoch = None, -1
        return fresh

    # --- collectives ----------------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor, what: str) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0. NCCL connects at a group's first collective, fetching
        keys that start with the secret, so a failure here is redacted like a failed wait."""
        assert self._group is not None, "join() first"
        try:
            return self._group.broadcast(tensor, 0)
        except Exception as error:
            self._failed(what, error)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as error:
            self._failed(what, error)

    def _broadcast_wait(self, tensor: torch.Tensor, what: str) -> None:
        self._wait(self._broadcast(tensor, what), what)

    def _failed(self, what: str, error: Exception) -> NoReturn:
        """Leave the group (the next push forms a new one) and raise ``error`` as a push failure, without the
        secret."""
        self.leave()
        failure = TimeoutError(
            f"weight push: {what} failed or timed out after {self.timeout.total_seconds():.0f} s: {error}"
        )
        if self.secret and self.secret in str(error):
            raise self._redacted(failure) from None  # the cause, printed with it, would show the secret
        raise failure from error

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self._broadcast_wait(size, "manifest size")
        if data is not None:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast_wait(payload, "manifest")
        return data if data is not None else payload.cpu().numpy().tobytes()

    # --- sender ---------------------------------------------------------------------------------

    def send(
        self,
        epoch: int,
        version: int,
        specs: list[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int = 256 * 2**20,
    ) -> PushStats:
        """Broadcast ``tensors`` (in ``specs`` order) as ``version``; rank 0 only."""
        assert self.rank == 0, "only rank 0 sends"
        started = time.perf_counter()
        self.join(epoch)
        manifest = Manifest(version, bucket_bytes, specs)
        self._broadcast_bytes(msgspec.msgpack.encode(manifest))
        stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
        buckets = plan_buckets(specs, bucket_bytes)
        layouts = [layout(specs, bucket) for bucket in buckets]
        # Two buffers: one is packed while the other is on the wire.
        buffers = [
            torch.empty(max(size for _, size in layouts), dtype=torch.uint8, device=self.device)
            for _ in range(min(2, len(buckets)))
        ]
        in_flight: collections.deque[dist.Work] = collections.deque()
        for k, (bucket, (offsets, size)) in enumerate(zip(buckets, layouts)):
            if len(in_flight) == len(buffers):  # this bucket's buffer is still being sent
                self._wait(in_flight.popleft(), f"bucket {k - 2} of v{version}")
            buffer = buffers[k % 2]
            for i, offset in zip(bucket, offsets):
                name, tensor = next(stream)
                spec = specs[i]
                if name != spec.name or tuple(tensor.shape) != spec.shape:
                    self.leave()
                    raise ValueError(
                        f"weight push v{version}: got {name} {tuple(tensor.shape)}, "
                        f"manifest says {spec.name} {spec.shape}"
                    )
                flat = tensor.detach().to(getattr(torch, spec.dtype)).contiguous().view(-1).view(torch.uint8)
                buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
            in_flight.append(self._broadcast(buffer[:size], f"bucket {k} of v{version}"))
        while in_flight:  # oldest first
            self._wait(in_flight.popleft(), f"last buckets of v{version}")
        num_bytes = sum(s.num_bytes for s in specs)
        return PushStats(version, num_bytes, len(buckets), time.perf_counter() - started)

    def probe(self, epoch: int, num_bytes: int) -> float:
        """Seconds to broadcast ``num_bytes`` raw, once every member is in: the group's floor for a push.

        Every member calls it; a one-byte broadcast first lines the members up,
        so the timed broadcast measures the link, not who arrived last.
        """
        self.join(epoch)
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        self._broadcast_wait(torch.zeros(1, dtype=torch.uint8, device=self.device), "probe start")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        self._broadcast_wait(payload, "probe")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    # --- receiver -------------------------------------------------------------------------------

    def receive(self, epoch: int, version: int) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
        """Receive ``version`` from push ``epoch``; nothing is returned unless every bucket arrived.

        The manifest may carry a newer version than announced (as good: take
        it), never an older one.
        """
        assert self.rank > 0, "rank 0 sends"
        self.join(epoch)
        manifest = msgspec.msgpack.decode(self._broadcast_bytes(None), type=Manifest)
        received: list[tuple[str, torch.Tensor]] = []
        for k, bucket in enumerate(plan_buckets(manifest.tensors, manifest.bucket_bytes)):
            offsets, size = layout(manifest.tensors, bucket)
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast_wait(buffer, f"bucket {k} of v{manifest.version}")
            for i, offset in zip(bucket, offsets):
                spec = manifest.tensors[i]
                part = buffer[offset : offset + spec.num_bytes]
                received.append((spec.name, part.view(getattr(torch, spec.dtype)).view(spec.shape)))
        if manifest.version < version:
            raise ValueError(f"weight push: expected v{version}, the learner sent the older v{manifest.version}")
        return manifest, received


def push_world_size(push, ranks_per_engine: int) -> int:
    """The push group's size: the learner as rank 0, then ``push.generators`` engines of ``ranks_per_engine``
    ranks each (their tensor parallel size: every worker receives the whole version, and vLLM's loader takes
    its shard)."""
    return 1 + push.generators * ranks_per_engine


def open_group(push, rank: int, device: str | torch.device, ranks_per_engine: int = 1) -> WeightGroup:
    """A :class:`WeightGroup` from the run's ``push`` section (:class:`asyncrl.config.PushConfig`), of
    :func:`push_world_size` ranks."""
    device = torch.device(device)
    return WeightGroup(
        push.address,
        rank,
        push_world_size(push, ranks_per_engine),
        "nccl" if device.type == "cuda" else "gloo",
        push.timeout_s,
        device,
        read_secret(push),
    )
