"""Where a process waits: StallReport for work past its limit, and SIGUSR1 for any process's stacks."""

import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT

from asyncrl.launch.processes import Launch
from asyncrl.observe.logs import StallReport
from asyncrl.weights.folders import process_running as alive


class _Records(logging.Handler):
    """Keeps the records and sets ``arrived`` at each one."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.arrived = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.arrived.set()


def _logger(name: str) -> tuple[logging.Logger, _Records]:
    log, handler = logging.getLogger(name), _Records()
    log.addHandler(handler)
    log.propagate = False
    return log, handler


def _stuck_until(event: threading.Event) -> None:
    assert event.wait(30)


def test_work_past_the_limit_logs_every_threads_stack_then_that_it_finished():
    log, records = _logger("stall-past")
    # Real time, 0.05 s: the report comes from a threading.Timer, which no injected clock drives; the block
    # waits on the report itself, not on the time.
    report = StallReport(0.05, log, "learner.stall_report_s")
    release = threading.Event()
    helper = threading.Thread(target=_stuck_until, args=(release,), name="busy-helper", daemon=True)
    helper.start()
    with report.watch("learner step 7"):
        _stuck_until(records.arrived)  # the block ends only once the report is in
    release.set()
    helper.join(5)
    assert len(records.records) == 2
    stacks, finished = (r.getMessage() for r in records.records)
    assert re.match(r"learner step 7 still running after \d+ s \(learner.stall_report_s\)", stacks)
    assert stacks.index("thread MainThread:") < stacks.index("thread busy-helper:")  # the main thread first
    assert stacks.count("in _stuck_until") == 2  # where both threads wait
    assert re.fullmatch(r"learner step 7 finished after \d+ s", finished)
    assert report.after_s == 0.1  # a slow step does not report at every step; a later hang still does


def _timers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, threading.Timer)]


def test_work_within_the_limit_or_with_the_report_off_logs_nothing(monkeypatch):
    log, records = _logger("stall-within")
    before = set(_timers())
    with StallReport(30, log, "x").watch("quick"):
        (timer,) = set(_timers()) - before
    assert not timer.is_alive(), "the timer is cancelled and joined when the work ends: it can never report"

    def no_timer(*args, **kwargs):
        raise AssertionError("a report that is off arms no timer")

    monkeypatch.setattr(threading, "Timer", no_timer)
    with StallReport(0, log, "x").watch("off"):
        pass
    assert records.records == []


_STUCK = """
import os, signal, subprocess, sys, time
sys.path.insert(0, {root!r})
from asyncrl.observe import logs
logs.setup("learner[0]")
signal.signal(signal.SIGTERM, lambda *_: None)  # a step that never gets back to its SIGTERM flag
if {rank!r}:  # a second process in a session of its own, as torchrun starts each rank
    subprocess.Popen([sys.executable, "-c", {rank!r}], start_new_session=True)
print("ready", os.getpid(), flush=True)
def stuck_in_a_step():
    while True:  # a step that never ends, for the launcher to find hung
        time.sleep(0.05)
stuck_in_a_step()
"""


def test_a_learner_that_outlives_the_grace_period_writes_its_stacks_before_it_is_killed(tmp_path: Path):
    """Its ranks too, though torchrun starts each in a session of its own, beyond the learner's group."""
    launch = Launch("unused.yaml", [], tmp_path)
    log_path = tmp_path / "logs/learner.log"
    rank = _STUCK.format(root=str(ROOT), rank="")
    with open(log_path, "w") as out:
        launch.procs["learner"] = subprocess.Popen(
            [sys.executable, "-c", _STUCK.format(root=str(ROOT), rank=rank)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60  # real time: two Python processes start, however long that takes here
    while log_path.read_text().count("ready") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(pid) for pid in re.findall(r"ready (\d+)", log_path.read_text())]
    assert len(pids) == 2, log_path.read_text()
    launch.stop_all(grace_s=1, learner_grace_s=1)
    assert launch.procs["learner"].returncode == -signal.SIGKILL
    text = log_path.read_text()
    assert text.count("in stuck_in_a_step") == 2, text  # both processes' stacks
    deadline = time.monotonic() + 10  # real time: the kernel ends a SIGKILLed process when it gets to it
    while alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pids[1]), "the process in its own session outlived the stop"
