"""``asyncrl-generator --replicas N``: a replica that fails fails the command, and SIGTERM reaches every replica."""

import argparse
import signal
import subprocess
import sys
import threading

from conftest import wait_for

from generators import cli

POPEN = subprocess.Popen


class Config:
    def replica_overrides(self, i: int) -> list[str]:
        return []


def replicas_running(monkeypatch, programs: list[str]) -> None:
    """Each replica is one of ``programs`` (Python source) instead of a generator."""
    started = iter(programs)

    def start(argv, **kwargs):
        return POPEN([sys.executable, "-c", next(started)], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", start)


def run(n: int) -> int:
    return cli._run_replicas(argparse.Namespace(config=["c.yaml"], generator_id="g"), Config(), [], n)


def test_a_replica_killed_by_a_signal_fails_the_command(monkeypatch):
    replicas_running(monkeypatch, ["import sys; sys.exit(0)", "import os; os.kill(os.getpid(), 9)"])
    assert run(2) == 128 + 9
    replicas_running(monkeypatch, ["import sys; sys.exit(3)", "import sys; sys.exit(0)"])
    assert run(2) == 3
    replicas_running(monkeypatch, ["pass", "pass"])
    assert run(2) == 0


def test_sigterm_reaches_every_replica_and_the_command_waits_for_them(monkeypatch, tmp_path):
    def draining(i: int) -> str:  # a generator drains on SIGTERM, then ends well
        return (
            "import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            f"pathlib.Path({str(tmp_path / str(i))!r}).touch()\n"
            "time.sleep(60)\n"
            "sys.exit(1)"
        )

    replicas_running(monkeypatch, [draining(0), draining(1)])
    handlers = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: handlers.append(handler))
    done = []
    waiter = threading.Thread(target=lambda: done.append(run(2)))
    waiter.start()
    wait_for(lambda: handlers and (tmp_path / "0").exists() and (tmp_path / "1").exists())  # both listen
    handlers[0](signal.SIGTERM, None)  # what the command's own SIGTERM runs
    waiter.join(30)
    assert done == [0], "both replicas drained and ended well, well before their 60 s"
