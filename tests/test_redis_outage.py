"""A Redis outage in the middle of a real ``asyncrl run``: every process waits it out.

The server is stopped for real (SIGTERM by its PID: connections refused, not a
pause) and a new one is started on the same port and data directory, whose
append-only file brings the stream and the consumer group back. Nothing but
the server is restarted. ``asyncrl status`` shows the outage while it lasts.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port
from redis_server import RedisServer

from asyncrl.observe.metrics import read_metrics

# Real time throughout: the run is other processes, on their own clocks, and the outage is a real one.
pytestmark = [pytest.mark.slow, pytest.mark.realtime]
CONFIG = str(ROOT / "configs/ci-redis.yaml")
STEPS = 40
CHECKPOINT_EVERY = 20  # the outage (after step 8) meets the learner waiting for rollouts, not acking them
OUTAGE_S = 5.0


def test_a_run_waits_out_a_redis_outage(tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    run_dir = tmp_path / "run"
    coordinator = f"tcp://127.0.0.1:{free_port()}"  # known to the test, for asyncrl status
    output = open(tmp_path / "asyncrl-run.log", "w")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            CONFIG,
            "--run-dir",
            str(run_dir),
            "--timeout-s",
            "150",
            f"--buffer.redis_url={server.url}",
            f"--coordinator.address={coordinator}",
            f"--learner.total_steps={STEPS}",
            f"--learner.checkpoint_every_steps={CHECKPOINT_EVERY}",
        ],
        stdout=output,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )

    def log(name):
        return (run_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def buffer_status():
        out = subprocess.run(
            [sys.executable, "-m", "asyncrl.launch.cli", "status", CONFIG, "--address", coordinator, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)["buffer"]

    try:
        deadline = time.monotonic() + 90  # polls for the run's processes to get to step 8
        while len(read_metrics(run_dir)) < 8:
            assert run.poll() is None, (tmp_path / "asyncrl-run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 8 within 90s"
            time.sleep(0.05)
        server.stop()
        down_at = time.monotonic()
        seen = []  # the learner refreshes its status while it waits for Redis
        while time.monotonic() - down_at < OUTAGE_S - 1.0 and not (seen and seen[-1]["redis_outage_s"] > 0):
            seen.append(buffer_status())
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # Redis stays down OUTAGE_S in all
        steps_while_down = len(read_metrics(run_dir))
        server.start()
        assert run.wait(timeout=150) == 0, (tmp_path / "asyncrl-run.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)  # the launcher stops its learner and generators on the way out
            run.wait(timeout=60)
        output.close()
        server.stop()

    assert seen and seen[-1]["redis_outage_s"] > 0 and seen[-1]["redis_outages"] == 1, seen
    assert steps_while_down < STEPS, "the outage was over before the run's end"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    consumed = [json.loads(line)["id"] for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert len(consumed) == len(set(consumed)), "a rollout was trained twice"
    assert len(consumed) >= STEPS * 4 * 8 * 0.5
    # Both sides met the outage, waited, and carried on in the same process.
    for name in ("learner", "generator-0"):
        text = log(name)
        assert "is unreachable" in text and "is back after an outage of" in text, (name, text[-3000:])
        assert "Traceback" not in text, (name, text[-3000:])
