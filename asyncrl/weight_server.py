"""Weights over ZeroMQ, for generators on machines that share no file system with the learner.

The learner serves its published version folders on ``coordinator.weights_address``
(a ROUTER socket, one daemon thread) and announces them as ``served``
(:mod:`asyncrl.weight_transport`); each generator fetches the folder into a
local cache with :func:`fetch`, then loads it as it would a local folder. Files travel in
``CHUNK_BYTES`` pieces, one request per piece, so no message is large and a
slow generator never holds the server up. A fetch is written under a
temporary name and renamed when complete: a partial fetch is never loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict
from pathlib import Path

import zmq

from asyncrl import weight_delta
from asyncrl.protocol import WeightChunk, WeightFetch, decode, encode
from asyncrl.transport import Endpoint, RequestServer
from asyncrl.weights import version_dir

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20
WEIGHTS_FILE = "model.safetensors"
DELTA_NAME = "model.safetensors.delta"  # served in place of WEIGHTS_FILE to a client holding an older version


class WeightServer(RequestServer):
    """Serves ``weights_dir/vNNNNNN/*`` to :func:`fetch` clients.

    With ``deltas`` (``coordinator.weight_deltas``), a client that names the
    version it holds (``base``) gets :data:`DELTA_NAME`, the lossless
    compressed difference (:mod:`asyncrl.weight_delta`), in place of
    ``model.safetensors``. Each delta is computed once and kept for the
    other generators asking for the same pair.
    """

    def __init__(self, weights_dir: str | Path, address: str, curve_secret_file: str | None = None,
                 deltas: bool = True, keep_deltas: int = 8) -> None:
        self.weights_dir = Path(weights_dir)
        self.deltas, self.keep_deltas = deltas, keep_deltas
        self._delta_cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        super().__init__(address, "coordinator.weights_address", WeightFetch, self._answer, curve_secret_file)

    def _answer(self, request: WeightFetch, final: bool = True) -> WeightChunk:
        folder = version_dir(self.weights_dir, request.version)
        if not folder.is_dir():
            return WeightChunk(version=request.version, error=f"v{request.version} is not published (or pruned)")
        if not request.name:
            files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
            delta = self._delta(request.base, request.version)
            if delta is not None:
                del files[WEIGHTS_FILE]
                files[DELTA_NAME] = len(delta)
            return WeightChunk(version=request.version, files=files)
        if request.name == DELTA_NAME:
            delta = self._delta(request.base, request.version)
            if delta is None:
                return WeightChunk(version=request.version, name=request.name,
                                   error=f"no delta from v{request.base} (not published, or pruned)")
            data = delta[request.offset:request.offset + CHUNK_BYTES]
            return WeightChunk(version=request.version, name=request.name, offset=request.offset, data=data)
        path = folder / request.name
        if path.parent != folder or not path.is_file():
            return WeightChunk(version=request.version, name=request.name, error="no such file")
        with open(path, "rb") as f:
            f.seek(request.offset)
            data = f.read(CHUNK_BYTES)
        return WeightChunk(version=request.version, name=request.name, offset=request.offset, data=data)

    def _delta(self, base: int, version: int) -> bytes | None:
        """The delta ``base`` -> ``version``, or None when deltas are off or ``base`` is no longer published."""
        if not self.deltas or base < 0 or base == version:
            return None
        key = (base, version)
        if key not in self._delta_cache:
            old = version_dir(self.weights_dir, base) / WEIGHTS_FILE
            if not old.is_file():
                return None
            started = time.monotonic()
            try:
                data = weight_delta.encode(old, version_dir(self.weights_dir, version) / WEIGHTS_FILE, base, version)
            except (ValueError, FileNotFoundError) as exc:  # pruned meanwhile, or another model: send it whole
                log.warning("no delta v%d -> v%d: %s", base, version, exc)
                return None
            log.info("delta v%d -> v%d: %d bytes in %.2fs", base, version, len(data), time.monotonic() - started)
            self._delta_cache[key] = data
            while len(self._delta_cache) > self.keep_deltas:
                self._delta_cache.popitem(last=False)
        return self._delta_cache[key]


def fetch(version: int, address: str, cache_dir: str | Path, timeout_s: float,
          curve_secret_file: str | None = None, base: int | None = None) -> Path:
    """Copy served version ``version`` into ``cache_dir``; returns the local folder.

    With ``base``, a version already in ``cache_dir``, the server may send
    only what changed since it (:mod:`asyncrl.weight_delta`); the delta is
    applied and checked here. Every request waits at most ``timeout_s``;
    any failure raises and leaves nothing loadable behind.
    """
    final = version_dir(cache_dir, version)
    held = version_dir(cache_dir, base) / WEIGHTS_FILE if base is not None else None
    if held is None or not held.is_file():
        base, held = -1, None
    tmp = final.with_name(final.name + ".fetching")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    endpoint = Endpoint(zmq.DEALER, address, bind=False, field="coordinator.weights_address",
                        curve_secret_file=curve_secret_file)
    try:
        def ask(name: str = "", offset: int = 0) -> WeightChunk:
            endpoint.socket.send_multipart([b"", encode(WeightFetch(version=version, name=name, offset=offset,
                                                                    base=base))])
            if not endpoint.socket.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"weights v{version}: no answer from {address} within {timeout_s:.0f}s")
            chunk = decode(endpoint.socket.recv_multipart()[-1], WeightChunk)
            if chunk.error:
                raise FileNotFoundError(f"weights v{version} from {address}: {chunk.error}")
            return chunk

        for name, size in ask().files.items():
            with open(tmp / name, "wb") as f:
                while f.tell() < size:
                    chunk = ask(name, f.tell())
                    if not chunk.data:
                        raise ValueError(f"weights v{version}: {name} ended at {f.tell()} of {size} bytes")
                    f.write(chunk.data)
        if (tmp / DELTA_NAME).exists():
            weight_delta.apply(held, (tmp / DELTA_NAME).read_bytes(), tmp / WEIGHTS_FILE,
                               {"asyncrl_version": str(version)})
            (tmp / DELTA_NAME).unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        endpoint.close()
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in sorted(p for p in Path(cache_dir).glob("v[0-9]*") if p.is_dir() and p != final)[:-1]:
        shutil.rmtree(old, ignore_errors=True)  # keep the new version and the one serving now
    return final
