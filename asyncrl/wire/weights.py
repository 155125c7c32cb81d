"""The wire messages of weight versions: announcing one, fetching a served one, describing a pushed one.

Import them from :mod:`asyncrl.wire.protocol`, the one module that defines
what crosses a process boundary; this module is its part for weights.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from asyncrl.wire.schema import Seconds, TaggedMessage


class SharedHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to open a learner's shared-memory weight segment (:mod:`asyncrl.weights.shared`) on this machine."""

    kind: Literal["cuda", "file"]
    nbytes: int
    path: str = ""  # file: the segment's file
    # cuda: the physical GPU (its UUID, so that each process's CUDA_VISIBLE_DEVICES numbering does not
    # matter) and the storage's IPC handle, as torch.UntypedStorage._share_cuda_() returns it
    gpu_uuid: str = ""
    cuda_ipc: tuple[int, bytes, int, int, bytes, int, bytes, bool] | None = None


class WeightUpdate(TaggedMessage, tag="weights"):
    """Announces that policy version ``version`` can be loaded, and how it travels.

    ``transport`` is ``folder`` (an HF folder at ``uri``, ``file://``, which
    appears only once every byte of it is in place), ``served`` (the same
    folder, fetched over ZeroMQ from the learner), ``push`` (broadcast into
    the engines by push group ``epoch``) or ``shared`` (written into the
    learner's shared-memory segment ``shared`` on this machine);
    :mod:`asyncrl.weights.transports` reads it, nothing else.
    """

    version: int
    uri: str = ""
    num_bytes: int = 0
    published_s: float = 0.0
    transport: Literal["folder", "served", "push", "shared"] = "folder"
    epoch: int = 0
    shared: SharedHandle | None = None  # shared: the learner's segment on this machine
    # The learner process that announced it (its coordinator's session). A learner resumed from a checkpoint
    # numbers its versions on from the checkpoint's, so the same number may name other weights than the ones a
    # generator loaded before the restart: a version is (session, version), never the number alone.
    session: str = ""

    @property
    def identity(self) -> tuple[str, int]:
        return self.session, self.version


class WeightFetch(TaggedMessage, tag="weight_fetch"):
    """Asks a weight server for one chunk of a published version (``name=""``: its file list)."""

    version: int
    name: str = ""
    offset: int = 0
    base: int = -1  # a version the client holds: the server may send the difference from it instead
    wait_s: Seconds = 0.0  # the file list may wait this long for that difference, while the server makes it


class WeightChunk(TaggedMessage, tag="weight_chunk"):
    """A chunk of one file of a published version, or its file list (``files``).

    ``error`` is set when the version is gone (pruned) or the request was bad.
    """

    version: int
    name: str = ""
    offset: int = 0
    data: bytes = b""
    files: dict[str, int] = {}
    error: str = ""
    # The serving learner's session (WeightUpdate.session): a client told of another session's versions by
    # its coordinator is talking to another learner's server.
    session: str = ""


# --- from learner rank 0 to push receivers (typed, not tagged) ---


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a pushed version: its name, dtype (torch's name without ``torch.``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"tensor {self.name}: unsupported dtype {self.dtype!r}")
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


class Manifest(msgspec.Struct, frozen=True):
    """The first message of a weight push: the version and every tensor that follows, in order."""

    version: int
    bucket_bytes: int
    tensors: list[TensorSpec]
