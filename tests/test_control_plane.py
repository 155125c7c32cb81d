"""A live run cannot be knocked over: bad rollouts under real tickets, and status asked in a tight loop.

A hostile or buggy peer takes real prompt tickets from the coordinator and
sends groups with one bad member each (NaN log-prob, NaN reward, a token id
past the vocabulary, mismatched lengths, an oversized entry), plus entries
that do not decode at all. Each must be rejected with its reason, counted
exactly once, never trained on, and its group's ticket given back; the run
must finish with every logged loss finite.
"""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import pytest
import zmq
from conftest import ROOT, free_port
from redis_server import RedisServer

from asyncrl.control.client import CoordinatorClient
from asyncrl.launch import cli
from asyncrl.observe.metrics import read_metrics
from asyncrl.wire.protocol import Rollout, WeightUpdate, WorkReply, WorkRequest, encode
from asyncrl.wire.sockets import Endpoint

pytestmark = pytest.mark.slow
MAX_BYTES = 65536
# kind -> the fields that make one member of a group bad
BAD_MEMBERS = {
    "non_finite_logprobs": {"logprobs": [-0.5, float("nan"), -0.5]},
    "non_finite_reward": {"reward": float("nan")},
    "token_out_of_range": {"response_ids": [5, 4, 10**6]},
    "length_mismatch": {"logprobs": [-0.5, -0.5]},
    "oversize": {"prompt_ids": [1000] * 30000},  # ~90 KB: over buffer.max_message_bytes, under libzmq's guard
}
UNREADABLE = {
    "malformed": b"\xc1" * 64,
    "schema": encode(
        Rollout(
            rollout_id="attack-schema",
            group_id="x",
            group_size=1,
            prompt_index=0,
            prompt_ids=[1],
            response_ids=[2],
            logprobs=[-1.0],
            versions=[0],
            reward=0.0,
            finish_reason="stop",
            generator_id="attacker",
            created_s=0.0,
            schema=99,
        )
    ),
    "wrong_type": encode(WeightUpdate(version=1, uri="file:///nowhere")),
}


class Attacker(threading.Thread):
    """Takes real tickets like a generator, sends one poisoned group per ticket, then waits to be told to stop."""

    def __init__(self, coordinator_address: str, send) -> None:
        super().__init__(daemon=True)
        self.address, self.send = coordinator_address, send
        self.sent_ids: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            self.error = exc

    def _run(self) -> None:
        client = CoordinatorClient(self.address, timeout_s=2)
        version, kinds = 0, list(BAD_MEMBERS.items())
        deadline = time.monotonic() + 300  # real time: the learner is another process
        while time.monotonic() < deadline:
            try:
                # A long poll, as a generator's: the learner holds it up to coordinator.long_poll_s (1 s, under
                # this client's 2 s timeout) and answers as soon as there is work, a new version or a stop.
                request = WorkRequest(
                    generator_id="attacker", weight_version=version, max_groups=len(kinds), wait_s=1.0
                )
                reply = client.call(request, WorkReply)
            except TimeoutError:
                continue
            if reply.stop:
                client.close()
                return
            version = reply.latest.version if reply.latest else version
            for ticket in reply.tickets:  # each ticket poisoned at once, as a buggy generator would
                kind, fields = kinds.pop(0)
                self._send_group(ticket, kind, fields, version)
                if not kinds:
                    for data in UNREADABLE.values():
                        self.send(data)

    def _send_group(self, ticket, kind: str, fields: dict, version: int) -> None:
        group_size = 8
        for i in range(group_size):  # the good members first, so they wait in the learner when the bad one lands
            rollout = Rollout(
                rollout_id=f"attack-{kind}-{i}",
                group_id=ticket.group_id,
                group_size=group_size,
                prompt_index=ticket.prompt_index,
                prompt_ids=[1, 4, 5, 13],
                response_ids=[5, 4, 2],
                logprobs=[-0.5] * 3,
                versions=[version] * 3,
                reward=1.0,
                finish_reason="stop",
                generator_id="attacker",
                created_s=0.0,
            )
            if i == group_size - 1:
                rollout = msgspec.structs.replace(rollout, **fields)
            self.sent_ids.append(rollout.rollout_id)
            self.send(encode(rollout))


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            return reply.read().decode()
    except OSError:
        return None


def _run_under_attack(tmp_path, config: str, settings: list[str], send_factory, hammer_status: bool):
    coordinator = f"tcp://127.0.0.1:{free_port()}"
    learner_port, generator_port = free_port(), free_port()
    settings = [*settings, f"--prometheus.learner_port={learner_port}", f"--prometheus.generator_port={generator_port}"]
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "run",
        config,
        "--run-dir",
        str(run_dir),
        "--timeout-s",
        "400",
        f"--coordinator.address={coordinator}",
        f"--buffer.max_message_bytes={MAX_BYTES}",
        *settings,
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    attacker = Attacker(coordinator, send_factory())
    attacker.start()
    answered = 0
    scrapes = {"learner": None, "generator": None}
    try:
        while hammer_status and proc.poll() is None:
            if answered % 50 == 0:  # Prometheus scrapes both while the run trains
                for name, port in (("learner", learner_port), ("generator", generator_port)):
                    scrapes[name] = _scrape(port) or scrapes[name]
            # The real CLI command, in process: hundreds of status calls while the run trains.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                code = cli.main(["status", config, "--address", coordinator, "--json"])
            answered += code == 0
        output, _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    attacker.join(timeout=30)
    assert attacker.error is None, attacker.error
    return run_dir, attacker, answered, scrapes


def _check_every_bad_entry_was_rejected_and_nothing_reached_the_loss(run_dir, attacker, total_steps):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total_steps
    assert summary["rejected_messages"] == {kind: 1 for kind in [*BAD_MEMBERS, *UNREADABLE]}
    dropped = {d["id"]: d["reason"] for d in _lines(run_dir / "dropped.jsonl")}
    consumed = {c["id"] for c in _lines(run_dir / "consumed.jsonl")}
    assert not consumed & set(attacker.sent_ids), "nothing of a poisoned group was trained on"
    assert len(attacker.sent_ids) == 8 * len(BAD_MEMBERS)
    for kind in BAD_MEMBERS:
        assert dropped[f"attack-{kind}-7"] == kind
        assert {dropped[f"attack-{kind}-{i}"] for i in range(7)} <= {"rejected_group", "orphaned"}
        assert summary["samples_dropped"][kind] == 1
    # Each poisoned group gave its 8 admission slots back at once, not after ticket_timeout_s.
    assert summary["slots_released"].get("rejected") == 8 * len(BAD_MEMBERS)
    records = read_metrics(run_dir)
    assert len(records) == total_steps
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)


def test_a_zmq_run_rejects_poisoned_groups_and_answers_status_in_a_tight_loop(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"

    def send_factory():
        endpoint = Endpoint(zmq.PUSH, address, bind=False, field="attacker")
        return endpoint.socket.send

    run_dir, attacker, answered, scrapes = _run_under_attack(
        tmp_path,
        str(ROOT / "configs/ci-tiny.yaml"),
        [f"--buffer.address={address}", "--learner.total_steps=80"],
        send_factory,
        hammer_status=True,
    )
    _check_every_bad_entry_was_rejected_and_nothing_reached_the_loss(run_dir, attacker, 80)
    # Each call is a fresh CLI command (its own socket); how many fit in the run depends on the machine.
    assert answered >= 20, f"only {answered} status calls answered during the run"
    learner, generator = scrapes["learner"], scrapes["generator"]
    assert learner and generator, "both /metrics endpoints answered during the run"
    assert 'asyncrl_buffer_rejected_total{reason="non_finite_reward",run="ci-tiny"} 1.0' in learner
    step = float(re.search(r'^asyncrl_learner_step\{run="ci-tiny"\} (\S+)$', learner, re.M).group(1))
    assert 0 < step <= 80
    assert re.search(r'^asyncrl_generator_samples_total\{generator="gen-0"\} [1-9]', generator, re.M), generator


def test_a_synchronous_redis_run_rejects_poisoned_groups_without_waiting_on_their_tickets(tmp_path):
    """With max_staleness 0 each version admits exactly one step's groups, so a poisoned group whose ticket
    stayed out until ticket_timeout_s (600 s) would starve the learner past batch_timeout_s (30 s here)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        import redis

        stream = "asyncrl:attack"

        def send_factory():
            client = redis.Redis.from_url(server.url)
            return lambda data: client.xadd(stream, {b"m": data})

        run_dir, attacker, _, _ = _run_under_attack(
            tmp_path,
            str(ROOT / "configs/ci-redis.yaml"),
            [
                f"--buffer.redis_url={server.url}",
                f"--buffer.stream={stream}",
                "--learner.total_steps=40",
                "--staleness.max_staleness=0",
                "--learner.batch_timeout_s=30",
                "--buffer.outage_tolerance_s=20",
            ],
            send_factory,
            hammer_status=False,
        )
        _check_every_bad_entry_was_rejected_and_nothing_reached_the_loss(run_dir, attacker, 40)
    finally:
        server.stop()
