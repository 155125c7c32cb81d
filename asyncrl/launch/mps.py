"""CUDA MPS for a run whose learner and generators share a GPU (``mps.enabled``).

Two processes on one GPU take turns on it: each gets the whole GPU for a
time slice, so a generator's small decode kernels and the learner's step
never run at once. Under NVIDIA's Multi-Process Service one server runs the
kernels of every client side by side. A run starts a control daemon of its
own, with its sockets in a private folder (``CUDA_MPS_PIPE_DIRECTORY``: a
system daemon, if any, stays untouched) and its logs in
``RUN_DIR/logs/mps``; each process it starts gets that folder, and its side's
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` where set. While the run goes on the
daemon is asked which processes are its clients, and ``summary.json`` says
how many were seen: a process that cannot reach the daemon runs without MPS,
silently, so that count is how a user knows it took.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.config import MpsConfig, RunConfig


def shares_a_gpu(config: RunConfig) -> bool:
    """Whether the learner and a generator are placed on a common GPU (both ``devices`` set)."""
    if config.learner.devices is None or config.generator.devices is None:
        return False
    learner = {d.strip() for d in config.learner.devices.split(",")}
    return any(d.strip() in learner for d in config.generator.devices.split(","))


def wanted(config: RunConfig) -> tuple[bool, str]:
    """Whether this run starts an MPS daemon, and why (a line for the user where ``auto`` decides)."""
    mps = config.mps
    if mps.enabled is False:
        return False, "mps.enabled: false"
    if mps.enabled is True:
        return True, "mps.enabled: true"
    if not shares_a_gpu(config):
        return False, "mps.enabled: auto, and no generator shares a GPU with the learner"
    if shutil.which(mps.control) is None:
        return False, f"mps.enabled: auto, and {mps.control} is not installed: the processes take turns on the GPU"
    return True, "mps.enabled: auto, and the learner and a generator share a GPU"


def check(config: MpsConfig, local: bool = True) -> None:
    """Before any process starts: MPS is for a run on this machine, and ``mps.enabled: true`` needs the control
    program."""
    if config.enabled is not False and not local:
        raise ValueError(
            "mps.enabled is for asyncrl run on one machine; on a Ray cluster start the MPS daemon on each node "
            "(nvidia-cuda-mps-control -d), and every process there uses it"
        )
    if config.enabled is True and shutil.which(config.control) is None:
        raise ValueError(
            f"mps.enabled: true needs CUDA MPS's control program, and {config.control!r} was not found "
            "(it comes with the NVIDIA driver's utilities; mps.control names another)"
        )


class Daemon:
    """One run's MPS control daemon: started, asked for its clients, stopped.

    ``execute(argv, stdin, env, timeout_s)`` runs the control program and
    returns its exit code and output (``subprocess.run`` by default).
    """

    def __init__(
        self,
        config: MpsConfig,
        log_dir: Path,
        execute: Callable[[list[str], str | None, dict[str, str], float], tuple[int, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 5.0,
    ) -> None:
        self.config, self.log_dir = config, log_dir
        self.execute = execute or _execute
        self.clock, self.poll_s = clock, poll_s
        self.pipe: Path | None = None
        self.clients: set[int] = set()
        self._asked: float | None = None

    def env(self, side: str) -> dict[str, str]:
        """What a process of ``side`` ("learner" or "generator") needs to be the daemon's client."""
        env = self._paths()
        share = getattr(self.config, f"{side}_thread_percentage")
        if share is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
        return env

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pipe = Path(tempfile.mkdtemp(prefix="asyncrl-mps-"))  # a short path: it holds Unix sockets
        code, output = self._control(["-d"])
        if code != 0:
            self._remove_pipe()
            raise RuntimeError(
                f"the MPS control daemon did not start ({self.config.control} -d exited {code}): {output}"
            )

    def ask(self, command: str) -> str:
        code, output = self._control([], command + "\n")
        if code != 0:
            raise RuntimeError(f"the MPS control daemon did not answer {command!r} (exit {code}): {output}")
        return output

    def observe(self) -> None:
        """Note the daemon's clients, at most once every ``poll_s`` (called on every tick of a run's loop)."""
        now = self.clock()
        if self._asked is not None and now - self._asked < self.poll_s:
            return
        self._asked = now
        try:
            for server in self.ask("get_server_list").split():
                self.clients.update(int(pid) for pid in self.ask(f"get_client_list {server}").split())
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            pass  # a daemon that does not answer now may next time; the count says what was seen

    def stop(self) -> None:
        """Ask the daemon to quit (its server follows once its clients are gone); remove its sockets."""
        if self.pipe is None:
            return
        try:
            self._control([], "quit\n")
        except subprocess.TimeoutExpired:
            pass
        finally:
            self._remove_pipe()

    def summary(self) -> dict[str, object]:
        return {"clients_seen": len(self.clients), "logs": str(self.log_dir)}

    def _paths(self) -> dict[str, str]:
        assert self.pipe is not None, "start the daemon first"
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _control(self, args: list[str], stdin: str | None = None) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"} | self._paths()
        return self.execute([self.config.control, *args], stdin, env, self.config.timeout_s)

    def _remove_pipe(self) -> None:
        if self.pipe is not None:
            shutil.rmtree(self.pipe, ignore_errors=True)
            self.pipe = None


def _execute(argv: list[str], stdin: str | None, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    # Output to a file, not a pipe: the daemon `-d` forks may hold its parent's output open, and a pipe would
    # keep `run` waiting for it.
    with tempfile.TemporaryFile("w+") as output:
        done = subprocess.run(
            argv, input=stdin, env=env, timeout=timeout_s, stdout=output, stderr=subprocess.STDOUT, text=True
        )
        output.seek(0)
        return done.returncode, output.read().strip()


@contextmanager
def daemon_for(config: RunConfig, out: Path, say: Callable[[str], None] = print) -> Iterator[Daemon | None]:
    """The run's daemon while the block runs, if it wants one (``mps.enabled``); stopped however it ends."""
    on, why = wanted(config)
    if config.mps.enabled == "auto":
        say(f"asyncrl run: CUDA MPS {'on' if on else 'off'} ({why})")
    if not on:
        yield None
        return
    daemon = Daemon(config.mps, out / "logs" / "mps")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
