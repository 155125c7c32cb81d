"""Weights handed over in shared memory on one machine: CUDA IPC on one GPU, a ``/dev/shm`` file on CPU.

The learner owns one segment for its lifetime and writes every version into
it; the announcement carries a :class:`SharedHandle`, which generators open
once (``storage._share_cuda_()`` on a GPU, as the colocated modes of verl
and OpenRLHF hand weights over; a file mapped ``MAP_SHARED`` on CPU). Nothing
touches the disk and nothing travels over a process group, which NCCL refuses
between two ranks of one GPU.

Layout::

    [version: int64] [manifest length: int64] [manifest: msgpack list of TensorSpec] [tensors, 256-byte aligned]

The first word is a sequence lock. The learner sets it to ``WRITING`` before
the first byte of a version changes and to the version once every byte is in
place (and, on a GPU, the copies have completed). A reader copies the whole
tensor area into its own buffer and accepts the copy only if the word held
the same version before and after. A version overwritten under it is
:class:`Superseded`, and the reader waits for the newer announcement: the
engine is never loaded from a torn copy. The reader's private copy costs one
model's worth of memory and a device-to-device copy (well under a millisecond
for SmolLM2 on an H200).

On a GPU both sides synchronise the device between the word and the data,
so the order holds across processes. On CPU it rests on the copy being
complete, in the other process's view, before the word changes: x86 keeps
stores in order; elsewhere, the copy and the store of the word are separate
torch operations, between which the interpreter lock is released and taken
again, and those atomic operations are full barriers.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import torch

from asyncrl.wire.protocol import SharedHandle, TensorSpec

WRITING = -1  # the version word while a version is being written
_HEADER = 16  # version, manifest length
_ALIGN = 256
_PREFIX = "asyncrl-weights-"


class Superseded(RuntimeError):
    """The segment no longer holds the announced version: a newer one is being written or was written."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Superseded: {message}")  # recognisable after vLLM's collective_rpc re-raises it


def superseded(error: BaseException) -> bool:
    """Whether ``error`` (possibly re-raised by another layer) says the learner moved past the version."""
    return isinstance(error, Superseded) or "Superseded: " in str(error)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight segment: unknown dtype {name!r}")
    return dtype


def _layout(specs: Sequence[TensorSpec]) -> tuple[bytes, int, list[tuple[TensorSpec, int]]]:
    """The encoded manifest, where the tensor area starts, and each tensor's offset in the segment."""
    manifest = msgspec.msgpack.encode(list(specs))
    start = _aligned(_HEADER + len(manifest))
    offsets, at = [], start
    for spec in specs:
        offsets.append((spec, at))
        at = _aligned(at + spec.num_bytes)
    return manifest, start, offsets


def _views(storage: torch.Tensor, offsets: Iterable[tuple[TensorSpec, int]], base: int = 0) -> dict[str, torch.Tensor]:
    """Named tensors over ``storage`` (a flat uint8 tensor) at each spec's offset minus ``base``."""
    return {
        spec.name: storage[at - base : at - base + spec.num_bytes].view(_dtype(spec.dtype)).view(spec.shape)
        for spec, at in offsets
    }


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _sweep_orphans(folder: Path) -> None:
    """Remove segment files no learner holds any more (one killed before it could remove its own).

    A learner holds a shared lock on its file for as long as it runs, so a file
    that takes an exclusive lock at once has no learner, whatever the PID
    namespace; files of other users are left alone.
    """
    for path in folder.glob(f"{_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except OSError:
            pass  # held by a running learner, or not ours to remove
        finally:
            os.close(fd)


class SharedSegment:
    """The learner's side: one segment, every version written into it in place."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device | str) -> None:
        self.device = torch.device(device)
        manifest, start, offsets = _layout(specs)
        nbytes = offsets[-1][1] + offsets[-1][0].num_bytes if offsets else start
        self.specs = list(specs)
        self.num_bytes = sum(s.num_bytes for s in specs)
        self._path: Path | None = None
        self._lock: int | None = None
        if self.device.type == "cuda":
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            ipc = self._buffer.untyped_storage()._share_cuda_()
            self.handle = SharedHandle(
                kind="cuda", nbytes=nbytes, gpu_uuid=_gpu_uuid(self.device.index or 0), cuda_ipc=tuple(ipc)
            )
        else:
            folder = _shm_dir()
            _sweep_orphans(folder)
            self._path = folder / f"{_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
            self._lock = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # this user only
            fcntl.flock(self._lock, fcntl.LOCK_SH)  # held while this learner runs (see _sweep_orphans)
            atexit.register(self.close)
            try:
                os.posix_fallocate(self._lock, 0, nbytes)  # fail now, not with SIGBUS at the first write
            except OSError as error:
                self.close()
                raise OSError(
                    f"weight segment: cannot reserve {nbytes / 2**20:.0f} MiB in {folder} ({error}); "
                    "enlarge it (docker: --shm-size) or set learner.shared_weights: false"
                ) from error
            self._buffer = torch.from_file(str(self._path), shared=True, size=nbytes, dtype=torch.uint8)
            self.handle = SharedHandle(kind="file", nbytes=nbytes, path=str(self._path))
        self._word = self._buffer[:_HEADER].view(torch.int64)
        self._set_word(WRITING)
        self._word[1:2].fill_(len(manifest))
        self._buffer[_HEADER : _HEADER + len(manifest)].copy_(torch.frombuffer(bytearray(manifest), dtype=torch.uint8))
        self._tensors = _views(self._buffer, offsets)
        _sync(self.device)

    def _set_word(self, value: int) -> None:
        self._word[0:1].fill_(value)
        _sync(self.device)

    def write(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write ``version`` in place: every named tensor of the manifest, exactly once.

        On an error the rest of ``tensors`` is still consumed (under ZeRO-3 the
        other ranks are in the gather's collectives) and the word stays
        ``WRITING``: readers keep the version they have.
        """
        if version < 0:
            raise ValueError(f"weight segment: version must be >= 0, got {version}")
        self._set_word(WRITING)
        seen = set()
        tensors = iter(tensors)
        for name, tensor in tensors:
            target = self._tensors.get(name)
            if target is None or tuple(tensor.shape) != tuple(target.shape):
                for _ in tensors:
                    pass
                raise ValueError(f"weight segment: {name} {tuple(tensor.shape)} is not in its manifest")
            target.copy_(tensor, non_blocking=True)
            seen.add(name)
        if len(seen) != len(self._tensors):
            raise ValueError(f"weight segment: v{version} lacks {sorted(set(self._tensors) - seen)[:3]}")
        _sync(self.device)
        self._set_word(version)  # only now can a reader accept it

    def close(self) -> None:
        """Free the segment: its GPU memory now, rather than in the interpreter's teardown; remove the file (CPU).

        Call it once no generator reads the segment any more. On a CPU, readers
        that opened the file keep their mapping.
        """
        if self.device.type == "cuda" and self._buffer is not None:
            self._tensors, self._word, self._buffer = {}, None, None
            torch.cuda.ipc_collect()  # the storage shared through CUDA IPC is released here
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _local_gpu(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _gpu_uuid(index) == uuid:
            return index
    raise RuntimeError(
        f"weight segment: its GPU {uuid} is not visible to this process "
        "(the learner and this generator must share a GPU)"
    )


class SharedView:
    """A generator's side: the segment opened once, read into a private copy on ``device`` per version."""

    def __init__(self, handle: SharedHandle, device: torch.device | str) -> None:
        self.handle = handle
        self.device = torch.device(device)
        if handle.kind == "cuda":
            if handle.cuda_ipc is None:
                raise ValueError("weight segment: a cuda handle without its IPC handle")
            index = _local_gpu(handle.gpu_uuid)
            with torch.cuda.device(index):
                storage = torch.UntypedStorage._new_shared_cuda(index, *handle.cuda_ipc[1:])
            self._segment = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)
            self._home = torch.device("cuda", index)
        else:
            if not Path(handle.path).exists():
                raise FileNotFoundError(f"weight segment {handle.path} is gone (its learner exited)")
            self._segment = torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
            self._home = torch.device("cpu")
        if self._segment.numel() < handle.nbytes:
            raise ValueError(f"weight segment: {self._segment.numel()} bytes, its handle says {handle.nbytes}")
        words = self._segment[:_HEADER].view(torch.int64).cpu()
        length = int(words[1])
        if not 0 < length <= handle.nbytes - _HEADER:
            raise ValueError(f"weight segment: manifest length {length} is out of range")
        raw = bytes(self._segment[_HEADER : _HEADER + length].cpu().numpy())
        self.specs = msgspec.msgpack.decode(raw, type=list[TensorSpec])
        _, self._start, offsets = _layout(self.specs)
        self._copy = torch.empty(handle.nbytes - self._start, dtype=torch.uint8, device=self.device)
        self._tensors = _views(self._copy, offsets, base=self._start)

    def version(self) -> int:
        """The version the segment holds now (``WRITING`` while one is being written)."""
        return int(self._segment[:8].view(torch.int64).item())

    def read(self, version: int, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """A private copy of ``version``; raises :class:`Superseded` if the learner has moved past it.

        Waits up to ``timeout_s`` while a version is being written (the announcement can arrive
        before the learner's write completes only if the learner published again meanwhile).
        """
        deadline = time.monotonic() + timeout_s
        while (held := self.version()) == WRITING:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight segment: still being written after {timeout_s:.0f} s")
            time.sleep(0.001)
        if held != version:
            if held > version:
                raise Superseded(f"weights v{version}: the segment already holds v{held}")
            raise ValueError(f"weights v{version} announced, but the segment holds v{held}")
        self._copy.copy_(self._segment[self._start : self.handle.nbytes], non_blocking=True)
        _sync(self.device)
        _sync(self._home)
        if (now := self.version()) != version:
            raise Superseded(
                f"weights v{version}: overwritten (now v{now}) while it was copied; the newer version is announced next"
            )
        return list(self._tensors.items())


class ViewCache:
    """The view of the segment a process last opened; a learner restart brings a new handle."""

    def __init__(self) -> None:
        self._view: SharedView | None = None

    def view(self, handle: SharedHandle, device: torch.device | str) -> SharedView:
        if self._view is None or self._view.handle != handle:
            self._view = None  # the old mapping and its private copy go before the new ones are made
            self._view = SharedView(handle, device)
        return self._view
