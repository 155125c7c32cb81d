"""Weights over ZeroMQ, for generators on machines that share no file system with the learner.

The learner serves its published version folders on ``coordinator.weights_address``
(a ROUTER socket, one daemon thread) and announces them as ``served``
(:mod:`asyncrl.weights.transports`); each generator fetches the folder into a
local cache with :func:`fetch`, then loads it as it would a local folder. Files travel in
``CHUNK_BYTES`` pieces, one request per piece, so no message is large and a
slow generator never holds the server up; deltas are computed on a thread of
their own for the same reason, while the file lists that wait for them are
held (a long poll, not a blocked thread). A fetch is written under a
temporary name and renamed when complete: a partial fetch is never loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

import msgspec
import zmq

from asyncrl.observe import trace
from asyncrl.weights import delta as weight_delta
from asyncrl.weights.folders import version_dir
from asyncrl.weights.open_versions import OpenVersions
from asyncrl.wire.protocol import ErrorReply, WeightChunk, WeightFetch, decode, encode
from asyncrl.wire.sockets import Endpoint, RequestServer

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20
WEIGHTS_FILE = "model.safetensors"
DELTA_NAME = "model.safetensors.delta"  # served in place of WEIGHTS_FILE to a client holding an older version
# The delta cache's default bound, in model files. A delta is served only when under half the file, so this
# holds the newest four at least: enough for generators up to four versions behind. Next to what the learner
# already keeps of the model (weights, gradients and optimizer states: 8 bf16 files and more with Adam), two
# files more is a bounded, modest cost, where a count alone let large deltas add up to several models.
DELTA_CACHE_MODELS = 2
MAX_QUEUED_DELTAS = 4  # pairs waiting for the delta thread; clients asking for more get whole files meanwhile
MAX_DELTA_PAIRS = 64  # pairs remembered, counting those found not worth a delta (which hold no bytes)
FETCH_WINDOW = 8  # chunk requests a generator keeps in flight while it fetches a version
MAX_DELTA_WAIT_S = 120.0  # the longest a file list is held for its delta (the client's wait_s, at most this)


_MAKING = object()  # a delta the delta thread is making


class DeltaGone(ValueError):
    """A delta offered in a file list was dropped from the server's cache before all of it was fetched."""


class OtherLearner(RuntimeError):
    """The weight server answers for another learner (session) than the one whose versions the generator was
    told of: right after a learner restart, until the next announcement; for long, two runs' addresses mixed."""

    def __init__(self, address: str, serving: str, expected: str) -> None:
        super().__init__(
            f"coordinator.weights_address {address} serves the weights of learner session {serving}, "
            f"not those of the learner at coordinator.address (session {expected}): give every process of the "
            "run the same coordinator.address and coordinator.weights_address"
        )


class WeightServer(RequestServer):
    """Serves ``weights_dir/vNNNNNN/*`` to :func:`fetch` clients.

    With ``deltas`` (``coordinator.weight_deltas``), a client that names the
    version it holds (``base``) gets :data:`DELTA_NAME`, the lossless
    compressed difference (:mod:`asyncrl.weights.delta`), in place of
    ``model.safetensors``. A delta of a large model takes seconds to compute,
    so a thread of its own computes them, one at a time, while the serving
    thread answers on: a client's file list waits for its delta up to the
    request's ``wait_s`` (generators ask right after a version is announced,
    all for the same delta), then gets the whole file, as does a client
    whose delta is over half the file (too little saved to be worth
    applying it). Each delta is computed once and kept for
    the other generators asking for the same pair, in a cache of at most
    ``delta_cache_bytes`` (default: :data:`DELTA_CACHE_MODELS` times the
    model file).
    """

    def __init__(
        self,
        weights_dir: str | Path,
        address: str,
        curve_secret_file: str | None = None,
        deltas: bool = True,
        delta_cache_bytes: int | None = None,
        session: str = "",
    ) -> None:
        self.weights_dir = Path(weights_dir)
        self.session = session  # the learner's (WeightUpdate.session), in every answer
        self.deltas, self.delta_cache_bytes = deltas, delta_cache_bytes
        self._model_bytes = 0  # the newest model file a delta was computed for
        self._lock = threading.Lock()  # the cache and the queue, shared by the serving and the delta threads
        self._ready: OrderedDict[tuple[int, int], bytes | None] = OrderedDict()  # None: the whole file is better
        self._queued: set[tuple[int, int]] = set()
        self._todo: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._open = OpenVersions()  # the files of the versions served last
        if deltas:
            threading.Thread(target=self._compute_deltas, name="weight-deltas", daemon=True).start()
        super().__init__(
            address,
            "coordinator.weights_address",
            WeightFetch,
            trace.traced(self._answer),
            curve_secret_file,
            max_hold_s=MAX_DELTA_WAIT_S,
            recheck_s=0.1,
        )

    def _answer(self, request: WeightFetch, final: bool = True) -> WeightChunk | None:
        chunk = self._chunk(request, final)
        return None if chunk is None else msgspec.structs.replace(chunk, session=self.session)

    def _chunk(self, request: WeightFetch, final: bool) -> WeightChunk | None:
        if request.name and request.name != DELTA_NAME:  # from the file opened with its version's list, if any
            data = self._open.read(request.version, request.name, request.offset, CHUNK_BYTES)
            if data is not None:
                return WeightChunk(version=request.version, name=request.name, offset=request.offset, data=data)
        folder = version_dir(self.weights_dir, request.version)
        if not folder.is_dir():
            return WeightChunk(version=request.version, error=f"v{request.version} is not published (or pruned)")
        try:
            return self._answer_from(folder, request, final)
        except FileNotFoundError:  # the learner pruned it after the check above: no longer published either
            return WeightChunk(
                version=request.version, name=request.name, error=f"v{request.version} was pruned while being served"
            )

    def _answer_from(self, folder: Path, request: WeightFetch, final: bool) -> WeightChunk | None:
        """The answer to ``request`` from ``folder``, which was there a moment ago (the learner may prune it)."""
        if not request.name:
            delta = self._delta(request.base, request.version)
            if delta is _MAKING and not final:
                return None  # held until the delta thread is done (it wakes the server) or the wait is over
            files = self._open.open(request.version, folder)  # readable to the end of the fetch, pruned or not
            if isinstance(delta, bytes):
                del files[WEIGHTS_FILE]
                files[DELTA_NAME] = len(delta)
            return WeightChunk(version=request.version, files=files)
        if request.name == DELTA_NAME:
            delta = self._delta(request.base, request.version, make=False)
            if not isinstance(delta, bytes):
                return WeightChunk(
                    version=request.version,
                    name=request.name,
                    error=f"the delta from v{request.base} is no longer held: fetch the whole file",
                )
            data = delta[request.offset : request.offset + CHUNK_BYTES]
            return WeightChunk(version=request.version, name=request.name, offset=request.offset, data=data)
        path = folder / request.name
        if path.parent != folder or not path.is_file():
            return WeightChunk(version=request.version, name=request.name, error="no such file")
        with open(path, "rb") as f:
            f.seek(request.offset)
            data = f.read(CHUNK_BYTES)
        return WeightChunk(version=request.version, name=request.name, offset=request.offset, data=data)

    def _delta(self, base: int, version: int, make: bool = True) -> bytes | object | None:
        """The delta ``base`` -> ``version`` if it is ready and worth sending; :data:`_MAKING` while the delta
        thread makes it; None: send the whole file.

        Never waits: with ``make``, a pair not asked for before is queued for
        the delta thread, unless :data:`MAX_QUEUED_DELTAS` wait there already.
        """
        if not self.deltas or base < 0 or base == version:
            return None
        key = (base, version)
        with self._lock:
            if key in self._ready:
                self._ready.move_to_end(key)  # in use: evicted last
                return self._ready[key]
            if make and key not in self._queued and len(self._queued) < MAX_QUEUED_DELTAS:
                self._queued.add(key)
                self._todo.put(key)
            return _MAKING if key in self._queued else None

    def _compute_deltas(self) -> None:
        """The delta thread: one delta at a time, so at most two versions are in memory for it."""
        while (key := self._todo.get()) is not None and not self._closed.is_set():
            try:
                data = self._compute(*key)
            except Exception:  # noqa: BLE001  (this thread computes every later delta too)
                log.exception("delta v%d -> v%d failed; clients get the whole file", *key)
                data = None
            with self._lock:
                self._queued.discard(key)
                self._ready[key] = data
                limit = self.delta_cache_bytes or DELTA_CACHE_MODELS * self._model_bytes
                held = sum(len(d) for d in self._ready.values() if d)
                while len(self._ready) > 1 and (held > limit or len(self._ready) > MAX_DELTA_PAIRS):
                    _, dropped = self._ready.popitem(last=False)
                    held -= len(dropped or b"")
            if not self._closed.is_set():
                with contextlib.suppress(OSError):  # closed meanwhile: nobody is held any more
                    self.wake()  # the file lists held for it

    def _compute(self, base: int, version: int) -> bytes | None:
        """The delta ``base`` -> ``version``, or None where the whole file is the better answer."""
        old, new = (version_dir(self.weights_dir, v) / WEIGHTS_FILE for v in (base, version))
        started = time.monotonic()
        try:
            size = new.stat().st_size
            data = weight_delta.encode(old, new, base, version)
        except (ValueError, OSError) as exc:  # pruned meanwhile, or another model: it goes whole
            log.warning("no delta v%d -> v%d: %s", base, version, exc)
            return None
        self._model_bytes = size
        if len(data) > size // 2:
            log.info(
                "delta v%d -> v%d: %d bytes, over half of the file's %d: clients get the whole file",
                base,
                version,
                len(data),
                size,
            )
            return None
        log.info("delta v%d -> v%d: %d bytes in %.2fs", base, version, len(data), time.monotonic() - started)
        return data

    def close(self) -> None:
        """Stop serving; the delta thread stops after the delta it is computing, if any."""
        self._closed.set()
        self._todo.put(None)
        super().close()
        self._open.close()


def fetch(
    version: int,
    address: str,
    cache_dir: str | Path,
    timeout_s: float,
    curve_secret_file: str | None = None,
    base: int | None = None,
    session: str = "",
) -> Path:
    """Copy served version ``version`` into ``cache_dir``; returns the local folder.

    With ``base``, a version already in ``cache_dir``, the server may send
    only what changed since it (:mod:`asyncrl.weights.delta`); the delta is
    applied and checked here. Every answer is awaited at most ``timeout_s``;
    any failure raises and leaves nothing loadable behind. With ``session``
    (the announcing learner's), a server answering for another learner
    raises :class:`OtherLearner`.
    """
    final = version_dir(cache_dir, version)
    held = version_dir(cache_dir, base) / WEIGHTS_FILE if base is not None else None
    if held is None or not held.is_file():
        base, held = -1, None
    tmp = final.with_name(final.name + ".fetching")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    endpoint = Endpoint(
        zmq.DEALER, address, bind=False, field="coordinator.weights_address", curve_secret_file=curve_secret_file
    )
    try:
        asking = _Fetch(endpoint, version, base, session, timeout_s)
        asking.copy(asking.files(), tmp)
        if (tmp / DELTA_NAME).exists():
            delta = (tmp / DELTA_NAME).read_bytes()
            weight_delta.apply(held, delta, tmp / WEIGHTS_FILE, {"asyncrl_version": str(version)})
            (tmp / DELTA_NAME).unlink()
            log.info(
                "weights v%d: applied the delta from v%d (%d bytes for a file of %d)",
                version,
                base,
                len(delta),
                (tmp / WEIGHTS_FILE).stat().st_size,
            )
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


class _Fetch:
    """One version's requests over one connection, and their answers, checked.

    Chunks are asked for ``FETCH_WINDOW`` at a time, so a version costs about
    one round trip per window rather than one per chunk: what keeps a fetch
    near the link's bandwidth when the learner is a few milliseconds away.
    """

    def __init__(self, endpoint: Endpoint, version: int, base: int, session: str, timeout_s: float) -> None:
        self.endpoint, self.version, self.base, self.session, self.timeout_s = (
            endpoint,
            version,
            base,
            session,
            timeout_s,
        )
        self.address = endpoint.address
        self.dropped = endpoint.disconnects()  # a drop during the fetch ends it: what was asked is lost with it

    def files(self) -> dict[str, int]:
        """The version's files and sizes (a delta in place of the weights where the server made one)."""
        # The file list may wait for a delta being made: for half the time this fetch may take per answer.
        self._ask("", 0, wait_s=self.timeout_s / 2 if self.base >= 0 else 0.0)
        files = self._answer("").files
        for name in files:  # names from the wire: one holding a path would write outside the cache
            if name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ValueError(f"weights v{self.version} from {self.address}: {name!r} is not a plain file name")
        return files

    def copy(self, files: dict[str, int], folder: Path) -> None:
        """Every chunk of ``files`` into ``folder``, ``FETCH_WINDOW`` requests in flight."""
        wanted = deque((name, offset) for name, size in files.items() for offset in range(0, size, CHUNK_BYTES))
        handles = {name: os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in files}
        try:
            in_flight = 0
            while wanted or in_flight:
                while wanted and in_flight < FETCH_WINDOW:
                    self._ask(*wanted.popleft())
                    in_flight += 1
                chunk = self._answer(None)
                in_flight -= 1
                size = files.get(chunk.name, -1)
                if size < 0 or len(chunk.data) != min(CHUNK_BYTES, size - chunk.offset):
                    raise ValueError(
                        f"weights v{self.version}: {chunk.name} at {chunk.offset} came with {len(chunk.data)} bytes "
                        f"of a file of {size}"
                    )
                os.pwrite(handles[chunk.name], chunk.data, chunk.offset)
        finally:
            for handle in handles.values():
                os.close(handle)

    def _ask(self, name: str, offset: int, wait_s: float = 0.0) -> None:
        request = WeightFetch(version=self.version, name=name, offset=offset, base=self.base, wait_s=wait_s)
        self.endpoint.socket.send_multipart([b"", encode(request)])

    def _answer(self, name: str | None) -> WeightChunk:
        """The next answer (to a request for ``name``, where said), or the error it means."""
        endpoint, version, address = self.endpoint, self.version, self.address
        # A version was just announced, so its server is up: one whose connection dropped, or that nothing
        # accepts connections for, is a learner that stopped. That ends the wait at once, where the whole
        # timeout (weight_load_timeout_s) would hold this generator away from the coordinator, which it waits
        # for with patience through a learner restart.
        if not endpoint.wait_for_reply(
            self.timeout_s, lambda: endpoint.disconnects() > self.dropped or endpoint.down()
        ):
            if endpoint.disconnects() > self.dropped:
                raise TimeoutError(
                    f"weights v{version}: the connection to {address} (coordinator.weights_address) dropped "
                    "before it answered: the learner stopped or restarted"
                )
            within = "" if endpoint.down() else f" within {self.timeout_s:g}s"
            raise TimeoutError(
                f"weights v{version}: no answer from {address} (coordinator.weights_address){within}: "
                f"{endpoint.trouble()}"
            )
        chunk = decode(endpoint.socket.recv_multipart()[-1], (WeightChunk, ErrorReply))
        if isinstance(chunk, WeightChunk) and self.session and chunk.session and chunk.session != self.session:
            raise OtherLearner(address, chunk.session, self.session)
        if isinstance(chunk, ErrorReply):  # its handler failed: the server's refusal, as a pruned version is
            raise FileNotFoundError(f"weights v{version} from {address}: the server failed: {chunk.reason}")
        if chunk.error and chunk.name == DELTA_NAME:  # evicted since it was offered: the whole file is still there
            raise DeltaGone(f"weights v{version} from {address}: {chunk.error}")
        if chunk.error:
            raise FileNotFoundError(f"weights v{version} from {address}: {chunk.error}")
        return chunk
