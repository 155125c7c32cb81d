"""Logging set-up shared by every entrypoint."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator


def setup(name: str) -> logging.Logger:
    """One line per record, prefixed with the process's role; level from ASYNCRL_LOG_LEVEL."""
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    # DeepSpeed calls collectives that torch has deprecated, once per parameter bucket.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    return logging.getLogger(name)


class StallReport:
    """Logs every thread's Python stack when a piece of work runs longer than ``after_s`` (once per process).

    A step that never ends otherwise leaves nothing in the log: this says where
    each thread is, so a wait in a compile, a collective or a lock can be told
    apart without attaching a debugger. ``after_s`` <= 0 turns it off.
    """

    def __init__(self, after_s: float, log: logging.Logger, setting: str) -> None:
        self.after_s, self.log, self.setting = after_s, log, setting
        self.reported = False

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        if self.after_s <= 0 or self.reported:
            yield
            return
        started = time.monotonic()
        timer = threading.Timer(self.after_s, self._report, (what, started))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _report(self, what: str, started: float) -> None:
        self.reported = True
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != threading.main_thread().ident)
        stacks = [f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                  for ident, frame in frames if ident != threading.get_ident()]  # the main thread first
        self.log.warning("%s has run for %.0f s; the stack of every thread follows (reported once; %s sets when)\n%s",
                         what, time.monotonic() - started, self.setting, "\n".join(stacks))
