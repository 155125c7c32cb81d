"""Where environments run: an asyncio loop in a daemon thread, off the generation loop.

An environment's ``reset`` and ``step`` (and the tools they call) may wait on
I/O for seconds; the generator's own thread must keep the engine stepping
meanwhile. Coroutine functions run on this loop; plain functions run each in
a daemon thread, at most ``workers`` at once. Every call has a time limit; a
call that runs past it is abandoned (a plain function's thread is left to
finish, and cannot keep the process from exiting).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable
from typing import Any

from asyncrl.envs.tools import in_daemon_thread


class EnvLoop:
    """Runs environment calls concurrently, each as a :class:`concurrent.futures.Future`."""

    def __init__(self, workers: int = 64) -> None:
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="env-loop", daemon=True)
        self._thread.start()
        self._started.wait(timeout=10.0)
        self._slots = asyncio.Semaphore(workers)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> concurrent.futures.Future:
        """``fn(*args)``, awaited if it is (or returns) a coroutine; raises :class:`TimeoutError` through the
        future once ``timeout_s`` passes."""
        return asyncio.run_coroutine_threadsafe(self._call(fn, args, timeout_s), self.loop)

    async def _call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        try:
            async with self._slots, asyncio.timeout(timeout_s):  # one limit for the call and what it returns
                if inspect.iscoroutinefunction(fn):
                    return await fn(*args)
                result = await in_daemon_thread(fn, *args)
                return await result if inspect.isawaitable(result) else result
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:  # SystemExit (argparse, sys.exit) would end the loop: its episode is dropped
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Stop the loop; calls in flight are abandoned."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
