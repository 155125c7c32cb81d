"""Lossless deltas between two published versions, for generators that fetch weights over a network.

One optimizer step moves every fp32 master weight a little, but most of
those moves are below bf16's resolution, so most published bf16 values do
not change at all, and those that do change mostly in their low bits. The
delta is the bitwise XOR of the two versions' tensors: zero where nothing
changed, exactly invertible (``base XOR delta`` is the new version, bit for
bit). Each tensor's XOR is split into byte planes (all first bytes, then
all second bytes...), which puts the rarely-changing sign and exponent
bytes together, and the whole is compressed with zstandard.

A delta carries a BLAKE2b digest of the new version's tensors; applying
it checks the result, so a wrong base can never load silently.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zstandard

if TYPE_CHECKING:
    import torch

MAGIC = "asyncrl-xor-delta-1"


class DeltaHeader(msgspec.Struct, frozen=True):
    """What the payload holds: tensors in order, and the digest of the version they make."""

    magic: str
    base: int
    version: int
    names: list[str]
    shapes: list[list[int]]
    digest: str


def _read(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``model.safetensors`` file."""
    from safetensors.torch import load_file

    return load_file(str(path))


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bits as an integer array (bf16 has no numpy dtype; its bits do)."""
    import torch

    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(bits).numpy()


def digest(tensors: dict[str, np.ndarray]) -> str:
    """BLAKE2b of every tensor's bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).view(np.uint8))
    return h.hexdigest()


def encode(base_file: Path, target_file: Path, base: int, version: int, level: int = 3) -> bytes:
    """The delta that turns ``base_file``'s tensors into ``target_file``'s (both ``model.safetensors``)."""
    old, new = _read(base_file), _read(target_file)
    if old.keys() != new.keys() or any(old[k].shape != new[k].shape or old[k].dtype != new[k].dtype for k in new):
        raise ValueError(f"v{base} and v{version} hold different tensors: no delta between them")
    names = sorted(new)
    old_raw, new_raw = {n: _raw(old[n]) for n in names}, {n: _raw(new[n]) for n in names}
    header = DeltaHeader(
        magic=MAGIC,
        base=base,
        version=version,
        names=names,
        shapes=[list(new[n].shape) for n in names],
        digest=digest(new_raw),
    )
    head = msgspec.msgpack.encode(header)
    stream = zstandard.ZstdCompressor(level=level, threads=-1).compressobj()
    body = [stream.compress(_planes(np.bitwise_xor(old_raw[name], new_raw[name]))) for name in names]
    body.append(stream.flush())
    return len(head).to_bytes(4, "little") + head + b"".join(body)


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _planes(xor: np.ndarray) -> bytes:
    """Byte planes of one tensor's XOR: byte 0 of every element, then byte 1, ...

    Shifts and masks on whole words: a byte-strided transpose is several times slower.
    """
    words = xor.reshape(-1).view(_UNSIGNED[xor.itemsize])
    return b"".join(((words >> (8 * i)) & 0xFF).astype(np.uint8).tobytes() for i in range(xor.itemsize))


def _words(planes: bytes, like: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_planes`, shaped and typed like ``like``."""
    unsigned = _UNSIGNED[like.itemsize]
    stacked = np.frombuffer(planes, np.uint8).reshape(like.itemsize, -1)
    words = stacked[0].astype(unsigned)
    for i in range(1, like.itemsize):
        words |= stacked[i].astype(unsigned) << unsigned(8 * i)
    return words.view(like.dtype).reshape(like.shape)


def header_of(data: bytes) -> DeltaHeader:
    """The header of a delta from :func:`encode`, read without decompressing the payload.

    Raises ValueError if ``data`` is not such a delta: a header that does not decode, or another magic.
    """
    size = int.from_bytes(data[:4], "little")
    header = msgspec.msgpack.decode(data[4 : 4 + size], type=DeltaHeader)
    if header.magic != MAGIC:
        raise ValueError(f"not a weight delta (magic {header.magic!r})")
    return header


def apply(base_file: Path, data: bytes, out_file: Path, metadata: dict[str, str] | None = None) -> DeltaHeader:
    """Write the new version's ``model.safetensors`` to ``out_file``; raises if the result is not the version."""
    import torch
    from safetensors.torch import save_file

    header = header_of(data)
    size = int.from_bytes(data[:4], "little")
    payload = zstandard.ZstdDecompressor().stream_reader(data[4 + size :])
    old = _read(base_file)
    if sorted(old) != header.names:
        raise ValueError(f"delta v{header.base}->v{header.version}: the base holds other tensors")
    new: dict[str, np.ndarray] = {}
    for name, shape in zip(header.names, header.shapes):
        base = _raw(old[name])
        if list(base.shape) != shape:
            raise ValueError(
                f"delta v{header.base}->v{header.version}: {name} has shape {list(base.shape)}, the delta {shape}"
            )
        delta = _words(_read_exactly(payload, base.nbytes), base)
        new[name] = np.bitwise_xor(base, delta, out=np.empty_like(base))  # out: an array, even of 0 dimensions
    if digest(new) != header.digest:
        raise ValueError(
            f"delta v{header.base}->v{header.version} applied to another base: the result does not "
            "match the version's digest"
        )
    # Same names, shapes and bits as the version, and a delta is only made between tensors of one dtype.
    tensors = {name: torch.from_numpy(new[name]).view(old[name].dtype) for name in header.names}
    save_file(tensors, str(out_file), metadata={"format": "pt", **(metadata or {})})
    return header


def _read_exactly(stream, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            raise ValueError("weight delta ended early")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
