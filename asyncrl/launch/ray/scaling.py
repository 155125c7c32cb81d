"""The pool file ``asyncrl scale`` talks through, and ``asyncrl scale`` itself.

Elastic pool: ``asyncrl scale RUN_DIR --generators N`` writes
``RUN_DIR/ray/scale.json``; the driver polls it, starts or removes
generator actors (:class:`~asyncrl.launch.ray.pool.GeneratorPool`), and
reports in ``RUN_DIR/ray/pool.json`` (both JSON via msgspec). A new
generator loads the latest published version before it takes tickets (a
weight push group has a fixed size, so a run with ``push.address`` cannot be
scaled). A removed one gets SIGTERM: it finishes and writes the groups it
holds, tells the learner it leaves, then exits; only one that outlives
``ray.drain_timeout_s`` is killed, and its tickets are reissued when its
lease runs out.

Nothing here imports Ray: ``asyncrl scale`` only reads and writes files.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Literal

import msgspec

POLL_S = 0.5  # the driver's loop, and asyncrl scale waiting for the pool to follow


class ScaleRequest(msgspec.Struct):
    """``RUN_DIR/ray/scale.json``: the generator count ``asyncrl scale`` asks for."""

    generators: int
    request_id: str


class GeneratorState(msgspec.Struct):
    """One generator actor as the driver last saw it."""

    state: Literal["starting", "running", "restarting", "draining", "done", "dead"]
    node: str | None = None
    pid: int | None = None  # the generator process
    actor_pid: int | None = None  # the Ray worker hosting it
    restarts: int = 0  # times Ray restarted its actor (seen as a new actor pid)
    reason: str | None = None  # why it is dead, or how it ended when the run stopped


class PoolState(msgspec.Struct):
    """``RUN_DIR/ray/pool.json``: the generator pool of a running ``asyncrl run --ray``."""

    ray_address: str
    driver_pid: int
    target: int
    generators: dict[str, GeneratorState]
    learner_pids: list[int] = []  # the learner's rank processes, rank 0 first
    learner_starts: int = 0  # 1, plus one per restart after a failure
    applied_request: str | None = None
    error: str | None = None  # why the last scale request was refused, or a generator could not be placed
    updated_s: float = 0.0


def pool_dir(run_dir: Path) -> Path:
    """Where the driver and ``asyncrl scale`` talk: ``RUN_DIR/ray`` (``scale.json`` in, ``pool.json`` out)."""
    return Path(run_dir) / "ray"


def read_pool(run_dir: str | Path) -> PoolState | None:
    """The pool file of a run, or None before the driver wrote one."""
    path = pool_dir(Path(run_dir)) / "pool.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=PoolState)
    except (FileNotFoundError, msgspec.DecodeError):  # absent, or caught mid-replace on a network FS
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step, so that a reader never finds it half written."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def scale(run_dir: str | Path, generators: int, timeout_s: float) -> PoolState:
    """Ask the run's driver for ``generators`` generators; wait until they run (or raise)."""
    if generators < 0:
        raise ValueError("--generators must be >= 0")
    pool = read_pool(run_dir)
    if pool is None:
        raise RuntimeError(f"{run_dir} has no ray/pool.json: is `asyncrl run --ray` running there?")
    request = ScaleRequest(generators=generators, request_id=uuid.uuid4().hex[:12])
    write_atomic(pool_dir(Path(run_dir)) / "scale.json", msgspec.json.encode(request))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = read_pool(run_dir)
        if pool is not None and pool.applied_request == request.request_id:
            if pool.error:
                raise RuntimeError(pool.error)
            if sum(g.state == "running" for g in pool.generators.values()) == generators and all(
                g.state in ("running", "done", "dead") for g in pool.generators.values()
            ):
                return pool
        time.sleep(POLL_S)
    raise TimeoutError(
        f"the pool did not reach {generators} running generators within {timeout_s:.0f}s; "
        f"see {Path(run_dir) / 'ray' / 'pool.json'} and {Path(run_dir) / 'logs' / 'ray.log'}"
    )


def read_request(out: Path) -> ScaleRequest | None:
    """The latest ``asyncrl scale`` request of the run in ``out``, or None (none yet, or caught mid-replace)."""
    try:
        return msgspec.json.decode((pool_dir(out) / "scale.json").read_bytes(), type=ScaleRequest)
    except (FileNotFoundError, msgspec.DecodeError):
        return None
