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
from pathlib import Path

import zmq

from asyncrl.protocol import WeightChunk, WeightFetch, decode, encode
from asyncrl.transport import Endpoint, RequestServer
from asyncrl.weights import version_dir

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20


class WeightServer(RequestServer):
    """Serves ``weights_dir/vNNNNNN/*`` to :func:`fetch` clients."""

    def __init__(self, weights_dir: str | Path, address: str, curve_secret_file: str | None = None) -> None:
        self.weights_dir = Path(weights_dir)
        super().__init__(address, "coordinator.weights_address", WeightFetch, self._answer, curve_secret_file)

    def _answer(self, request: WeightFetch, final: bool = True) -> WeightChunk:
        folder = version_dir(self.weights_dir, request.version)
        if not folder.is_dir():
            return WeightChunk(version=request.version, error=f"v{request.version} is not published (or pruned)")
        if not request.name:
            return WeightChunk(version=request.version,
                               files={p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()})
        path = folder / request.name
        if path.parent != folder or not path.is_file():
            return WeightChunk(version=request.version, name=request.name, error="no such file")
        with open(path, "rb") as f:
            f.seek(request.offset)
            data = f.read(CHUNK_BYTES)
        return WeightChunk(version=request.version, name=request.name, offset=request.offset, data=data)


def fetch(version: int, address: str, cache_dir: str | Path, timeout_s: float,
          curve_secret_file: str | None = None) -> Path:
    """Copy served version ``version`` into ``cache_dir``; returns the local folder.

    Every request waits at most ``timeout_s``; any failure raises and leaves
    nothing loadable behind.
    """
    final = version_dir(cache_dir, version)
    tmp = final.with_name(final.name + ".fetching")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    endpoint = Endpoint(zmq.DEALER, address, bind=False, field="coordinator.weights_address",
                        curve_secret_file=curve_secret_file)
    try:
        def ask(name: str = "", offset: int = 0) -> WeightChunk:
            endpoint.socket.send_multipart([b"", encode(WeightFetch(version=version, name=name,
                                                                    offset=offset))])
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
