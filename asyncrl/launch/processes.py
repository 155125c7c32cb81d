"""The processes a launcher starts: started in sessions of their own, stopped by process group, never left orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from asyncrl.tasks import child_env


class Launch:
    """The processes of one run and their logs (``resume``: appended to, after the logs of the run it continues,
    which may say why that one ended)."""

    def __init__(self, config_path: str, overrides: list[str], run_dir: Path, resume: bool = False) -> None:
        self.config_path = config_path
        self.overrides = overrides
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self,
        name: str,
        module: str,
        args: list[str],
        devices: str | None = None,
        env: dict[str, str | None] | None = None,
    ) -> None:
        """Start ``module`` as process ``name`` on GPUs ``devices`` (None: as the launcher sees them), with
        ``env`` over the launcher's environment (a key set to None is left out)."""
        log = open(self.logs / f"{name}.log", "a" if self.resume else "w")
        if self.resume:
            log.write(f"\n===== asyncrl run --resume, {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
            log.flush()
        extra = env or {}
        env = child_env(PYTHONUNBUFFERED="1", **{k: v for k, v in extra.items() if v is not None})
        for key in [k for k, v in extra.items() if v is None]:  # None: unset, whatever the launcher has
            env.pop(key, None)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, self.config_path, *self.overrides, *args],  # per-process args win
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=stop_with_launcher(),
        )

    def stop_all(self, grace_s: float = 10.0, learner_grace_s: float = 120.0) -> None:
        """Stop every process still running (by process group); SIGKILL what outlives its grace.

        The learner gets ``learner_grace_s`` (``learner.stop_timeout_s``) to
        finish its step and checkpoint. One that outlives it gets SIGUSR1
        first, which writes every thread's stack to its log, so a run stopped
        in a hung step says where; its descendants are signalled one by one
        too, since torchrun starts each rank in a session of its own, out of
        reach of the group.

        A generator drains on SIGTERM, which is worth it only while the
        learner runs to take what it writes: once the learner has exited,
        the generators get a second SIGTERM (which a draining generator obeys
        at once) and ``grace_s`` to exit, and those found running after the
        learner had already exited are killed straight away.
        """
        learner = self.procs.get("learner")
        learner_gone = learner is None or learner.poll() is not None
        if not learner_gone:
            print(
                f"asyncrl run: stopping; the learner finishes its step and checkpoints (up to "
                f"{learner_grace_s:.0f}s, learner.stop_timeout_s)",
                file=sys.stderr,
                flush=True,
            )
        for name, proc in self.procs.items():
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL if learner_gone and name != "learner" else signal.SIGTERM)
        if not learner_gone:
            try:
                learner.wait(timeout=learner_grace_s)
            except subprocess.TimeoutExpired:
                pass
            else:
                for name, proc in self.procs.items():
                    if name != "learner" and proc.poll() is None:
                        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=0 if name == "learner" else max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                below: list[int] = []
                if name == "learner":  # its log gets every thread's stack (asyncrl.observe.logs.setup): where it waited
                    below = _descendants(proc.pid)
                    # One process at a time: the ranks share the log, and stacks written at once interleave.
                    for pid in [proc.pid, *below]:
                        _signal_each([pid], signal.SIGUSR1)
                        time.sleep(0.25)
                    time.sleep(0.5)
                _signal_group(proc, signal.SIGKILL)
                _signal_each(below, signal.SIGKILL)
                proc.wait()

    def tail(self, name: str, lines: int = 15) -> str:
        return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])


def stop_with_launcher():
    """For Linux: what a child runs before it starts, so that it gets SIGTERM when the launcher dies, however
    the launcher dies (the out-of-memory killer, a SIGKILL after a sweep's grace): it would train on, orphaned.
    Elsewhere None: the launcher's own handlers (Ctrl-C, SIGTERM) still stop what it started."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    launcher = os.getpid()

    def set_death_signal() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def call_within(command: list[str], timeout_s: float, what: str, grace_s: float = 10.0) -> int:
    """Run ``command`` (one process and whatever it starts) to its end and return its exit code, or stop it
    after ``timeout_s`` (SIGTERM, SIGKILL after ``grace_s``) and return 124, as ``timeout(1)`` does.
    Ctrl-C stops it the same way."""
    proc = subprocess.Popen(command, env=child_env(), start_new_session=True, preexec_fn=stop_with_launcher())
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"{what}: not done after {timeout_s:g}s (--timeout-s): stopped", file=sys.stderr, flush=True)
        return_code = 124
    except KeyboardInterrupt:
        return_code = 130
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)  # and whatever it started that outlived it
    proc.wait(timeout=grace_s)
    return return_code


def interrupt_on_sigterm() -> Any:
    """SIGTERM (``kill``, ``timeout``, a scheduler) and SIGHUP (the terminal or SSH session closed) stop a run
    as Ctrl-C does: as a ``KeyboardInterrupt``, through the cleanup that stops the processes it started
    (without it, they would train on, orphaned).

    Returns the SIGTERM handler it replaced (None off the main thread, where signals cannot be handled). The
    handler restores the defaults first, so a second signal ends the process at once.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if signal.getsignal(signal.SIGHUP) is interrupt:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup a closed session stops nothing
        signal.signal(signal.SIGHUP, interrupt)
    return signal.signal(signal.SIGTERM, interrupt)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def _signal_each(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first (none once ``pid`` is gone)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
