"""Logging set-up shared by every entrypoint, and reports of where a process waits."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import NoReturn


def setup(name: str) -> logging.Logger:
    """One line per record, prefixed with the process's role; level from ASYNCRL_LOG_LEVEL."""
    logging.basicConfig(
        level=_level(os.environ.get("ASYNCRL_LOG_LEVEL", "INFO")),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    # DeepSpeed calls collectives that torch has deprecated, once per parameter bucket.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # `kill -USR1 PID` writes every thread's stack to stderr (the process's log under `asyncrl run`), from C,
    # so it works while the main thread is blocked in a kernel, a collective or a lock.
    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        except (AttributeError, OSError, ValueError, RuntimeError):  # a stderr without a file descriptor
            pass
    return logging.getLogger(name)


def _level(name: str) -> int:
    """ASYNCRL_LOG_LEVEL as a level: a name in any case (debug, INFO) or a number; INFO for anything else."""
    name = name.strip()
    if name.isdigit():
        return int(name)
    level = logging.getLevelName(name.upper())
    if isinstance(level, int):
        return level
    warnings.warn(f"ASYNCRL_LOG_LEVEL={name!r} is no log level (DEBUG, INFO, WARNING, ERROR): INFO", stacklevel=2)
    return logging.INFO


class StallReport:
    """Logs every thread's Python stack when a piece of work runs past ``after_s``.

    A step that never ends otherwise leaves nothing in the log: this says where
    each thread is, so a wait in a compile, a collective or a lock can be told
    apart without a debugger. A piece of work is reported once; after a report
    the limit doubles (up to 8 times the first), so slow but finishing steps
    are not reported at every step and a later hang still is. A reported
    piece of work that ends says so. ``after_s`` <= 0 turns it off.
    The report needs the GIL: a wait in C code that holds it is reported only
    by ``kill -USR1`` (see :func:`setup`).
    """

    def __init__(self, after_s: float, log: logging.Logger, setting: str) -> None:
        self.after_s, self.log, self.setting = after_s, log, setting
        self.most_s = 8 * after_s

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Run the block; if it is still running after the limit, log the stacks (the block goes on)."""
        if self.after_s <= 0:
            yield
            return
        started, done, reported = time.monotonic(), threading.Event(), threading.Event()
        timer = threading.Timer(self.after_s, self._report, (what, started, done, reported))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            done.set()
            timer.cancel()
            timer.join(10)  # a report under way is logged before the line that says the work ended
            if reported.is_set():
                self.log.warning("%s finished after %.0f s", what, time.monotonic() - started)
                self.after_s = self._next_s()

    def _next_s(self) -> float:
        return min(2 * self.after_s, self.most_s)

    def _report(self, what: str, started: float, done: threading.Event, reported: threading.Event) -> None:
        frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident)
        if done.is_set():  # the block ended while the timer fired
            return
        reported.set()
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        stacks = [
            f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
            for ident, frame in frames
            if ident != threading.get_ident()
        ]  # not this timer's own thread
        self.log.warning(
            "%s still running after %.0f s (%s); every thread's Python stack follows, the main "
            "thread first; later work is reported after %.0f s\n%s",
            what,
            time.monotonic() - started,
            self.setting,
            self._next_s(),
            "\n".join(stacks),
        )


def exit_now(code: int) -> NoReturn:
    """End this process with ``code``: its exit handlers run and its output is flushed, then it exits without the
    interpreter's teardown, which frees torch's (and DeepSpeed's) objects one by one: over a second for a
    learner that is done, which every run would wait for."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def ends_process(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """``main(argv)`` as a process's command: called without ``argv`` (the process's own command line), it
    ends the process with its exit code through :func:`exit_now` once done, skipping the interpreter's
    teardown, where a native thread left by an engine or torch could still abort a process whose work had
    ended well; called with ``argv``, it returns the code."""

    @functools.wraps(main)
    def command(argv: list[str] | None = None) -> int:
        code = main(argv)
        if argv is None:
            exit_now(code)
        return code

    return command
