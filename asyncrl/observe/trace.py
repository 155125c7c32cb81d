"""A timeline of every process of a run, as Chrome trace events (``--trace``).

With ``trace: true`` each process appends its spans to
``RUN_DIR/trace/<process>.json`` while it runs, and ``asyncrl run`` merges
them into ``RUN_DIR/trace.json`` at the end (``asyncrl trace RUN_DIR`` does
the same for services started by hand). Open it at https://ui.perfetto.dev
or in ``chrome://tracing``: one row per process and thread.

Each file is a JSON array written one event per line and never closed: the
trace-event format allows the closing bracket to be missing, so a process
killed mid-run still leaves a readable file. Timestamps are wall-clock
microseconds, which line processes of one machine up with each other.

Tracing off costs one attribute test per span: :func:`span` returns a
shared no-op context.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from time import monotonic  # its own name: tests stand a clock in for time.time_ns
from typing import Any

_NOOP = contextlib.nullcontext()
FLUSH_EVERY_S = 1.0  # the file's buffer is written out at least this often while spans come


class Tracer:
    """Writes complete (``X``) and counter (``C``) events of one process to ``path``."""

    def __init__(self, path: Path, process_name: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.pid = os.getpid()
        # Appended to: a restarted generator or a resumed learner keeps the timeline of the process before it.
        earlier = path.exists() and path.stat().st_size > 0
        self._file = open(path, "a", buffering=1 << 16)
        self._lock = threading.Lock()
        self._flushed_at = monotonic()
        self._threads: set[int] = set()
        self._file.write("\n" if earlier else "[\n")  # the process before may have been cut off mid-line
        self._write({"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": process_name}})

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        started = time.time_ns()
        try:
            yield
        finally:
            self.complete(name, started, time.time_ns(), **args)

    def complete(self, name: str, started_ns: int, ended_ns: int, **args: Any) -> None:
        """A span that already happened, from ``started_ns`` to ``ended_ns`` (``time.time_ns()``)."""
        event = {
            "name": name,
            "ph": "X",
            "ts": started_ns / 1000,
            "dur": (ended_ns - started_ns) / 1000,
            "pid": self.pid,
            "tid": self._tid(),
        }
        if args:
            event["args"] = args
        self._write(event)

    def counter(self, name: str, **values: float) -> None:
        self._write({"name": name, "ph": "C", "ts": time.time_ns() / 1000, "pid": self.pid, "args": values})

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._threads:
            self._threads.add(tid)
            self._write(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"name": threading.current_thread().name},
                }
            )
        return tid

    def _write(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":")) + ",\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                now = monotonic()
                if now - self._flushed_at >= FLUSH_EVERY_S:  # a killed process loses at most the last second
                    self._file.flush()
                    self._flushed_at = now


_tracer: Tracer | None = None


def configure(run_dir: str | Path, process_name: str) -> Tracer:
    """Start tracing this process into ``run_dir/trace/<process_name>.json``."""
    global _tracer
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in process_name)
    _tracer = Tracer(Path(run_dir) / "trace" / f"{safe}.json", process_name)
    atexit.register(_tracer.close)
    return _tracer


def enabled() -> bool:
    """Whether :func:`configure` started tracing in this process."""
    return _tracer is not None


def span(name: str, **args: Any):
    """``with trace.span("learner/forward"):`` records the block, or does nothing when tracing is off."""
    return _tracer.span(name, **args) if _tracer is not None else _NOOP


def complete(name: str, started_ns: int, ended_ns: int, **args: Any) -> None:
    """Record a span that already happened (``time.time_ns()`` bounds), or do nothing when tracing is off."""
    if _tracer is not None:
        _tracer.complete(name, started_ns, ended_ns, **args)


def traced(handle: Callable[[Any, bool], Any]) -> Callable[[Any, bool], Any]:
    """``handle`` of a request server, each answer it gives recorded as a span ``answer <RequestType>``.

    A held request's "nothing yet" (``None``) is no answer and leaves no span."""

    def answer(request: Any, final: bool = True) -> Any:
        started_ns = time.time_ns()
        reply = handle(request, final)
        if reply is not None:
            complete(f"answer {type(request).__name__}", started_ns, time.time_ns())
        return reply

    return answer


def counter(name: str, **values: float) -> None:
    """Record ``values`` as counter series under ``name`` at the current time, or do nothing when tracing is off."""
    if _tracer is not None:
        _tracer.counter(name, **values)


def read_events(path: Path) -> list[dict]:
    """The events of one process's file, whether or not the process closed it.

    One event per line; a line cut short by a killed process is skipped.
    """
    events = []
    for line in path.read_text().splitlines()[1:]:
        try:
            events.append(json.loads(line.rstrip(",")))
        except json.JSONDecodeError:
            continue
    return events


def merge(run_dir: str | Path) -> Path | None:
    """Merge ``run_dir/trace/*.json`` into ``run_dir/trace.json``; None when there is nothing to merge."""
    parts = sorted((Path(run_dir) / "trace").glob("*.json"))
    if not parts:
        return None
    events = [event for part in parts for event in read_events(part)]
    out = Path(run_dir) / "trace.json"
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")))
    return out


def summary(events: list[dict]) -> str:
    """Per process and span name: count, total and mean duration, and the share of the traced wall-clock.

    The table ``asyncrl trace RUN_DIR`` prints: where each process spent its
    time, busiest spans first, without opening a trace viewer.
    """
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        return "no spans"
    wall_us = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    totals: dict[tuple[str, str], list[float]] = {}
    for e in spans:
        entry = totals.setdefault((processes.get(e["pid"], str(e["pid"])), e["name"]), [0, 0.0])
        entry[0] += 1
        entry[1] += e["dur"]
    rows = sorted(totals.items(), key=lambda item: (item[0][0], -item[1][1]))
    width = max(len(name) for (_, name), _ in rows)
    lines = [f"{wall_us / 1e6:.1f} s traced"]
    current = None
    for (process, name), (count, total_us) in rows:
        if process != current:
            lines += ["", process]
            current = process
        lines.append(
            f"  {name:<{width}}  {count:>7d} x {total_us / count / 1000:8.2f} ms = {total_us / 1e6:7.2f} s"
            f"  {total_us / wall_us:6.1%}"
        )
    return "\n".join(lines)
