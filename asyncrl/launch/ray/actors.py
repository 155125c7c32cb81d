"""The Ray actor of ``asyncrl run --ray``: it hosts one real entrypoint as its child process.

Every learner rank and every generator is an :class:`EntrypointHost` actor
whose child is ``python -m learners.cli`` or ``python -m generators.cli``,
the same command line as without Ray. Hosting a child rather than calling
``generators.cli.main`` inside the actor keeps behaviour identical:

* the log goes to ``RUN_DIR/logs/NAME.log`` (a Ray worker's own output goes
  to Ray's session folder), appended to across restarts;
* signals mean what they mean without Ray: SIGTERM drains a generator and
  checkpoints a learner;
* torch, DeepSpeed and vLLM state (process groups, CUDA contexts, signal
  handlers, threads) lives and dies with the child, so a restart is a fresh
  process and never a half-torn-down one.

Actor and child live and die together. The child is started as ``python -m
asyncrl.launch.ray.actors PID ...``, which sets ``PR_SET_PDEATHSIG`` (Linux), checks that the
actor is still its parent and then execs the entrypoint, so the child is
killed when the actor's worker dies for any reason (a ``preexec_fn`` would do
the same, but is unsafe in a process with threads, as every Ray worker is).
The child leads its own process group, and :meth:`EntrypointHost.stop`
signals the whole group, so the processes it started (vLLM's engine core)
go with it. With ``exit_with_child`` (generators), a child that fails
ends the worker too (``os._exit``): Ray sees the actor die and restarts it
within its ``max_restarts``, running ``__init__`` again, which starts a new
child under the same generator id. A child that exits 0 (the learner said
stop, or it drained) leaves the actor idle with its exit code. Learner ranks
are hosted without ``exit_with_child``: all ranks must restart together, from
a checkpoint, so the driver does it (:mod:`asyncrl.launch.ray.driver`).

This module imports only the standard library (and ``ray`` inside methods),
so Ray can import it on any node by reference; nothing of asyncrl's
protocols crosses Ray, only command lines, exit codes and pids.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

_PR_SET_PDEATHSIG = 1


def _libc() -> Any | None:
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


class EntrypointHost:
    """One asyncrl process (learner rank or generator) inside one Ray actor."""

    def __init__(
        self,
        name: str,
        log_path: str,
        command: list[str] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        exit_with_child: bool = False,
    ) -> None:
        import ray

        self.name = name
        self.log_path = log_path
        self.exit_with_child = exit_with_child
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.proc: subprocess.Popen | None = None
        self._stopping = False
        if command is not None:
            self.start(command, cwd, env)

    def start(self, command: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> int:
        """Start the child (once); returns its pid."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already runs pid {self.proc.pid}")
        if cwd and not os.path.isdir(cwd):
            raise FileNotFoundError(
                f"{self.name}: working directory {cwd} does not exist on {socket.gethostname()}: "
                "check out asyncrl at the same path on every machine"
            )
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log = open(self.log_path, "a")
        log.write(
            f"[asyncrl ray] {self.name} {'restarted' if self.restarted else 'started'} on "
            f"{socket.gethostname()} (actor pid {os.getpid()}) at {time.strftime('%H:%M:%S')}\n"
        )
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.launch.ray.actors", str(os.getpid()), *command],
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            # PYTHONSAFEPATH: the working directory last on its import path (asyncrl.tasks.child_env says why)
            env={**os.environ, **(env or {}), "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        log.close()
        threading.Thread(target=self._watch, args=(self.proc,), name=f"watch-{self.name}", daemon=True).start()
        return self.proc.pid

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if code != 0 and self.exit_with_child and not self._stopping:
            with open(self.log_path, "a") as log:
                log.write(f"[asyncrl ray] {self.name} exited with {code}: ending its actor so that Ray restarts it\n")
            # What the child left behind (vLLM's engine core, its workers) would hold the GPU the restart needs.
            self._signal_group(signal.SIGKILL)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """Where this runs and how it is doing (plain values, for the driver's pool file)."""
        import ray

        return {
            "node": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "actor_pid": os.getpid(),
            "pid": self.proc.pid if self.proc else None,
            "restarted": self.restarted,
            "returncode": self.proc.poll() if self.proc else None,
        }

    def poll(self) -> int | None:
        """The child's exit code, or None while it runs (or before it started)."""
        return self.proc.poll() if self.proc else None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it, for torch.distributed's MASTER_ADDR/MASTER_PORT."""
        import ray

        from asyncrl.wire.ports import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def stop(self, grace_s: float, terminate: bool = True) -> int | None:
        """End the child's process group: SIGTERM it (a generator drains, a learner checkpoints), or with
        ``terminate`` false only wait for it to end by itself; SIGKILL once ``grace_s`` is over.

        Returns the child's exit code (None if it never started).
        """
        self._stopping = True
        if self.proc is None:
            return None
        if terminate and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        self._signal_group(signal.SIGKILL)  # what the child started and left behind
        return code

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass


def _exec_child(parent: int, argv: list[str]) -> None:
    """In the child: die with ``parent`` (the actor's worker), then become ``python ARGV``."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the actor died before the death signal was armed
        sys.exit(1)
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    _exec_child(int(sys.argv[1]), sys.argv[2:])
