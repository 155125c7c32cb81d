"""A throwaway ``redis-server`` for tests and benchmarks.

Each server listens on a free loopback port, keeps its files (log, AOF) in its
own directory and is stopped by its PID, never by name, so parallel test runs
and a system Redis on 6379 are left alone. ``redis-server`` must be on PATH:
CI installs it, and a missing binary fails loudly instead of skipping, so a
green run always means the Redis tests ran.

Use the ``redis_server`` fixture (import it into a test module), or
:class:`RedisServer` directly when a test restarts the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = "redis-server"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on loopback, with its data in ``directory``.

    ``start`` and ``stop`` can be called repeatedly: a restart reuses the port
    and the directory, so an append-only file written before is replayed.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        port: int | None = None,
        appendonly: bool = False,
        appendfsync: str = "always",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.directory = Path(directory)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and return once it answers PING; raise if it does not."""
        binary = shutil.which(REDIS_SERVER)
        if binary is None:
            raise RuntimeError(
                f"{REDIS_SERVER} is not on PATH: the Redis buffer tests and benchmark need it "
                "(Debian/Ubuntu: apt-get install -y redis-server)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--daemonize",
            "no",
            "--logfile",
            "",
            *self.extra_args,
        ]
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with code {self.process.returncode} at start; log tail:\n{self._log_tail()}"
                )
            if self._answers_ping():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer PING within {timeout_s}s; "
                    f"log tail:\n{self._log_tail()}"
                )
            time.sleep(0.02)  # real time: a redis-server process starting up

    def stop(self, *, hard: bool = False, timeout_s: float = 10.0) -> None:
        """Stop this server by its PID: SIGTERM (clean shutdown), or SIGKILL if ``hard`` (a crash)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout_s)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                # Still loading the AOF answers -LOADING; a password-protected one -NOAUTH.
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh in-memory ``redis-server`` (no RDB, no AOF) for one test."""
    server = RedisServer(tmp_path / "redis")
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()
