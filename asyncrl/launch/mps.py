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

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.config import MpsConfig, RunConfig
from asyncrl.launch.processes import stop_with_launcher


def shares_a_gpu(config: RunConfig) -> bool:
    """Whether the learner and a generator use a common GPU (a side without ``devices`` uses the first it sees)."""
    learner = {d.strip() for d in (config.learner.devices or "0").split(",")}
    return any(d.strip() in learner for d in (config.generator.devices or "0").split(","))


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
    """Before any process starts: ``mps.enabled: true`` is for a run on this machine, and needs the control
    program."""
    if config.enabled is True and not local:
        raise ValueError(
            "mps.enabled: true is for asyncrl run on one machine; on a Ray cluster start the MPS daemon on each "
            "node (nvidia-cuda-mps-control -d), and every process there uses it"
        )
    if config.enabled is True and shutil.which(config.control) is None:
        raise ValueError(
            f"mps.enabled: true needs CUDA MPS's control program, and {config.control!r} was not found "
            "(it comes with the NVIDIA driver's utilities; mps.control names another)"
        )


Execute = Callable[[list[str], str | None, dict[str, str], float], tuple[int, str]]
Spawn = Callable[[list[str], dict[str, str], Path], subprocess.Popen]


class Daemon:
    """One run's MPS control daemon: started, asked for its clients, stopped.

    The control program runs in the foreground (``-f``) as the launcher's
    child, in a session of its own and stopped with the launcher however the
    launcher ends; a run's processes reach it through ``CUDA_MPS_PIPE_DIRECTORY``.
    ``spawn(argv, env, log)`` starts it, ``execute(argv, stdin, env, timeout_s)``
    runs one control command and returns its exit code and output;
    ``clock``/``sleep`` time the wait for it to answer.
    """

    def __init__(
        self,
        config: MpsConfig,
        log_dir: Path,
        execute: Execute | None = None,
        spawn: Spawn | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        poll_s: float = 5.0,
    ) -> None:
        self.config, self.log_dir = config, log_dir
        self.execute, self.spawn = execute or _execute, spawn or _spawn
        self.clock, self.sleep, self.poll_s = clock, sleep, poll_s
        self.pipe: Path | None = None
        self.process: subprocess.Popen | None = None
        self.clients: set[int] = set()
        self._asked: float | None = None

    def env(self, side: str) -> dict[str, str | None]:
        """What a process of ``side`` ("learner" or "generator") needs to be the daemon's client (None: unset)."""
        share = getattr(self.config, f"{side}_thread_percentage")
        return {**self._pipe_env(), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None if share is None else str(share)}

    def start(self) -> None:
        """Start the daemon and wait (up to ``mps.timeout_s``) until it answers; stopped again if it does not."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pipe = _socket_folder()
        try:
            self.process = self.spawn([self.config.control, "-f"], self._daemon_env(), self.log_dir / "daemon.log")
            self._wait_until_it_answers()
        except BaseException:
            self.stop()
            raise

    def ask(self, command: str, timeout_s: float | None = None) -> str:
        """One control command's answer (``get_server_list``, ``get_client_list PID``, ...)."""
        try:
            code, output = self._control(command, timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the MPS control daemon did not answer {command!r} within {timeout_s}s") from None
        if code != 0:
            raise RuntimeError(f"the MPS control daemon did not answer {command!r} (exit {code}): {output}")
        return output

    def observe(self) -> None:
        """Note the daemon's clients, at most once every ``poll_s`` (called on every tick of a run's loop, so
        each query waits at most 5 s)."""
        now = self.clock()
        if self._asked is not None and now - self._asked < self.poll_s:
            return
        self._asked = now
        try:
            for server in self.ask("get_server_list", self._query_s).split():
                self.clients.update(int(pid) for pid in self.ask(f"get_client_list {server}", self._query_s).split())
        except (RuntimeError, ValueError):
            pass  # a daemon that does not answer now may next time; the count says what was seen

    def stop(self) -> None:
        """Ask the daemon to quit (its clients have exited by now), wait up to ``mps.timeout_s`` for it, kill it
        if it is still there; remove its sockets."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                if self._control("quit")[0] == 0:
                    process.wait(timeout=self.config.timeout_s)
            if process.poll() is None:
                process.kill()
                process.wait(timeout=self.config.timeout_s)
        if self.pipe is not None:
            shutil.rmtree(self.pipe, ignore_errors=True)
            self.pipe = None

    def summary(self) -> dict[str, object]:
        return {"clients_seen": len(self.clients), "logs": str(self.log_dir)}

    def _wait_until_it_answers(self) -> None:
        deadline = self.clock() + self.config.timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"the MPS control daemon exited as it started ({self.config.control} -f, exit {code}); its "
                    f"log: {self.log_dir / 'daemon.log'}"
                )
            try:
                self.ask("get_server_list", self._query_s)
                return
            except RuntimeError as exc:
                if self.clock() >= deadline:
                    raise RuntimeError(
                        f"{exc}; it did not answer within {self.config.timeout_s:g}s (mps.timeout_s)"
                    ) from None
            self.sleep(0.1)

    @property
    def _query_s(self) -> float:
        """How long a query asked while the run goes may take: a silent daemon must not hold its loop up."""
        return min(5.0, self.config.timeout_s)

    def _pipe_env(self) -> dict[str, str]:
        assert self.pipe is not None, "start the daemon first"
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe)}

    def _daemon_env(self) -> dict[str, str]:
        """The launcher's environment with the daemon's folders. Without the launcher's SM share, and without its
        CUDA_VISIBLE_DEVICES: under a daemon that sees fewer GPUs, clients number them from that set, and a
        process's ``devices`` would name another GPU than it does without MPS."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_VISIBLE_DEVICES")
        }
        return env | self._pipe_env() | {"CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _control(self, command: str, timeout_s: float | None = None) -> tuple[int, str]:
        return self.execute(
            [self.config.control], command + "\n", self._daemon_env(), timeout_s or self.config.timeout_s
        )


def _socket_folder() -> Path:
    """A new private folder for the daemon's Unix sockets, whose paths must stay under 108 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="asyncrl-mps-"))
    if len(str(folder)) > 60:  # a long TMPDIR
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix="asyncrl-mps-", dir="/tmp"))
    return folder


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session: a Ctrl-C reaches the launcher, which stops it last
            preexec_fn=stop_with_launcher(),
        )


def _execute(argv: list[str], stdin: str | None, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    done = subprocess.run(argv, input=stdin, env=env, timeout=timeout_s, capture_output=True, text=True)
    return done.returncode, (done.stdout + done.stderr).strip()


@contextmanager
def daemon_for(config: RunConfig, out: Path, say: Callable[[str], None] = print) -> Iterator[Daemon | None]:
    """The run's daemon while the block runs, if it wants one (``mps.enabled``); stopped however it ends. Under
    ``auto`` a control daemon that does not start or answer (a container without the permission, say) leaves
    the run without MPS, and says so; the MPS server itself starts with the first CUDA process, and a failure
    there fails that process as under ``true``."""
    on, why = wanted(config)
    if config.mps.enabled == "auto":
        say(f"asyncrl run: CUDA MPS {'on' if on else 'off'} ({why})")
    if not on:
        yield None
        return
    daemon = Daemon(config.mps, out / "logs" / "mps")
    try:
        daemon.start()
    except (RuntimeError, OSError) as exc:
        if config.mps.enabled is True:
            raise
        say(f"asyncrl run: CUDA MPS off after all: {exc}; the processes take turns on the GPU")
        yield None
        return
    try:
        yield daemon
    finally:
        daemon.stop()
