"""A generator drained by SIGTERM finishes its batch, says goodbye and stops; a second SIGTERM ends it at once.

Also ``asyncrl run``'s stop of its processes: generators drain only while the learner is there to take
their work.
"""

import logging
import select
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, DirectClient

from asyncrl.config import BufferConfig, load_config
from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.staleness import StalenessBound
from asyncrl.launch.processes import Launch
from asyncrl.wire.protocol import WorkReply, WorkRequest
from buffers import open_reader, open_writer
from generators.base import Sample
from generators.worker import GeneratorWorker


class SilentClient:
    """A learner that is gone: every call times out. Keeps what it was sent."""

    address = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.requests: list[WorkRequest] = []

    def call(self, request, expected):
        self.requests.append(request)
        raise TimeoutError("no answer within 1s")


class DrainedMidBatch:
    """Yields one group at a time, and drains the worker (as its SIGTERM handler would) after the first."""

    def __init__(self) -> None:
        self.version = 0
        self.worker: GeneratorWorker | None = None
        self.batches = 0

    def generate(self, requests, params, between_steps=None):
        self.batches += 1
        for k, request in enumerate(requests):
            yield request, [Sample([5, 2], [-0.1, -0.2], [0, 0], "stop", "3") for _ in range(params.n)]
            if k == 0:
                self.worker.drain()


def _worker(client, backend, name: str) -> tuple[GeneratorWorker, object]:
    config = load_config(
        None,
        ["--generator.samples_per_prompt=2", "--generator.groups_per_request=3", "--generator.learner_patience_s=300"],
    )
    buffer = BufferConfig(type="inproc", address=f"drain-{name}", capacity=100)
    worker = GeneratorWorker(
        config,
        "gen-0",
        backend,
        prompt_ids=lambda item: [1, 4, 5, 13],
        items=[{"prompt": "12=", "answer": "12"}] * 10,
        reward_fn=lambda text, item: 1.0,
        client=client,
        writer=open_writer(buffer),
    )
    return worker, open_reader(buffer)


def test_a_drained_generator_finishes_its_batch_then_leaves_holding_no_tickets(caplog):
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    backend = DrainedMidBatch()
    worker, reader = _worker(DirectClient(coordinator), backend, "mid-batch")
    backend.worker = worker
    with caplog.at_level(logging.INFO):
        worker.run()
    assert backend.batches == 1, "no work asked for after the drain"
    written = reader.get(max_items=100, timeout_s=1)
    assert len(written) == 3 * 2, "the whole batch in hand was written"
    # Every ticket it was given is a group in the buffer, on its way to the learner.
    assert {r.group_id for r in written} == {f"s-g{i}" for i in range(3)}
    assert all(coordinator.is_outstanding(f"s-g{i}") for i in range(3))
    assert coordinator.generators == {}, "the learner forgot it at its goodbye, not after generator_lease_s"
    assert "drained: no tickets left in hand" in caplog.text
    assert "the learner is done" not in caplog.text


def test_a_goodbye_forgets_the_generator_and_leaves_its_written_groups_to_arrive():
    coordinator = Coordinator(StalenessBound(4, 6), PromptCursor(10, 0), group_size=2, lease_s=60, session="s")
    reply = coordinator.handle_work(WorkRequest(generator_id="gen-0", weight_version=0, max_groups=2))
    assert len(reply.tickets) == 2
    bye = coordinator.handle_work(WorkRequest(generator_id="gen-0", weight_version=0, max_groups=0, leaving=True))
    assert isinstance(bye, WorkReply) and bye.stop and not bye.tickets
    assert "gen-0" not in coordinator.generators and not coordinator.generators_not_stopped()
    # The groups it wrote may still be in the buffer: their tickets are not given out again.
    assert all(coordinator.is_outstanding(t.group_id) for t in reply.tickets)
    assert not coordinator.bound.dropped


def test_a_draining_generator_whose_learner_is_gone_stops_at_the_first_timeout(caplog):
    client = SilentClient()
    worker, _ = _worker(client, DrainedMidBatch(), "silent")
    worker.drain()
    with caplog.at_level(logging.WARNING):
        worker.run()  # the goodbye goes unanswered: logged, not retried for learner_patience_s
    assert [r.leaving for r in client.requests] == [True], "one goodbye, sent once"
    assert "did not answer its goodbye" in caplog.text


# A signal a process sends itself is handled before os.kill returns to Python code: nothing waits.
_SIGTERM_TWICE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from generators.cli import drain_on_sigterm

class Worker:
    draining = False
    def drain(self):
        self.draining = True

worker = Worker()
drain_on_sigterm([worker])
os.kill(os.getpid(), signal.SIGTERM)
print("draining" if worker.draining else "not draining", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("still alive", flush=True)
"""


def test_the_first_sigterm_drains_and_the_second_ends_the_process():
    done = subprocess.run(
        [sys.executable, "-c", _SIGTERM_TWICE.format(root=str(ROOT))], capture_output=True, text=True, timeout=30
    )
    assert done.stdout.split() == ["draining"], done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


# A generator that drains, but whose batch never finishes (its learner is gone): only a second SIGTERM ends it.
# It says when it starts to drain.
_STUCK_DRAINING = """
import signal

def drain(*_):
    print("draining", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

signal.signal(signal.SIGTERM, drain)
print("ready", flush=True)
while True:
    signal.pause()
"""


# A learner that checkpoints for {seconds} s on SIGTERM, then exits 0. Real time: the launcher it stands
# against waits for real processes by the real clock.
_CHECKPOINTING_LEARNER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep({seconds}), sys.exit(0)))
print("ready", flush=True)
while True:
    signal.pause()
"""


def _start(launch: Launch, name: str, code: str) -> None:
    launch.procs[name] = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True
    )


def _wait_ready(launch: Launch, name: str) -> None:
    """Until the process prints "ready", which it does once its SIGTERM handler is set."""
    out = launch.procs[name].stdout
    assert select.select([out], [], [], 30)[0] and out.readline() == "ready\n", f"{name} did not start"


def test_stop_all_kills_generators_at_once_when_the_learner_has_exited(tmp_path: Path):
    launch = Launch("unused.yaml", [], tmp_path)
    _start(launch, "learner", "pass")
    _start(launch, "generator-0", _STUCK_DRAINING)
    launch.procs["learner"].wait(timeout=30)
    _wait_ready(launch, "generator-0")
    launch.stop_all(grace_s=20)
    assert launch.procs["generator-0"].returncode == -signal.SIGKILL
    assert launch.procs["generator-0"].stdout.read() == "", "killed at once, not asked to drain for nothing"


def test_the_learner_has_its_own_longer_grace_to_checkpoint(tmp_path: Path):
    """learner.stop_timeout_s: a ZeRO-3 checkpoint of a large model outlasts the generators' grace."""
    launch = Launch("unused.yaml", [], tmp_path)
    _start(launch, "learner", _CHECKPOINTING_LEARNER.format(seconds=2.5))
    _wait_ready(launch, "learner")
    # Real time (the launcher waits for real processes): no slow machine makes a 2.5 s checkpoint end within the
    # generators' 0.5 s grace, so only the learner's own grace lets it finish.
    launch.stop_all(grace_s=0.5, learner_grace_s=30)
    assert launch.procs["learner"].returncode == 0, "it checkpointed and exited, rather than being killed"


def test_stop_all_ends_draining_generators_once_the_learner_has_checkpointed(tmp_path: Path):
    launch = Launch("unused.yaml", [], tmp_path)
    _start(launch, "learner", _CHECKPOINTING_LEARNER.format(seconds=0.5))
    _start(launch, "generator-0", _STUCK_DRAINING)
    _wait_ready(launch, "learner")
    _wait_ready(launch, "generator-0")
    launch.stop_all(grace_s=20)
    assert launch.procs["learner"].returncode == 0
    # Drained while the learner checkpointed, then ended by a second SIGTERM: not the grace's SIGKILL.
    assert launch.procs["generator-0"].stdout.read() == "draining\n"
    assert launch.procs["generator-0"].returncode == -signal.SIGTERM
