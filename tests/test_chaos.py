"""Chaos with the Redis buffer: SIGKILL the learner several times and a generator once.

Every rollout a generator wrote must end trained exactly once (in the
learner's surviving history), dropped with a recorded reason, or still
waiting in the stream; none lost, none trained twice.
"""

import json
import os
import random
import signal
import subprocess
import time

import pytest
import redis
from conftest import ONE_THREAD_EACH, ROOT, free_port
from redis_server import RedisServer

from asyncrl.observe.metrics import read_metrics
from asyncrl.wire.protocol import decode

pytestmark = pytest.mark.slow
CONFIG = str(ROOT / "configs/ci-redis.yaml")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_kill_everything_and_nothing_is_lost_or_trained_twice(tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    run_dir = tmp_path / "run"
    settings = [
        f"--buffer.redis_url={server.url}",
        f"--coordinator.address=tcp://127.0.0.1:{free_port()}",
        *ONE_THREAD_EACH,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[str, subprocess.Popen] = {}

    def start(name, args):
        procs[name] = subprocess.Popen(
            args, stdout=open(tmp_path / f"{name}.log", "a"), stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )

    def start_learner(resume):
        start(
            "learner",
            ["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *settings] + (["--resume"] if resume else []),
        )

    def start_generator(i):
        start(
            f"gen-{i}",
            [
                "asyncrl-generator",
                CONFIG,
                "--generator-id",
                f"gen-{i}",
                "--produced-log",
                str(tmp_path / f"produced-{i}.txt"),
                # the buffer's accounting is the point: the transformers backend restarts in seconds where
                # vLLM's engine takes ten on a CPU
                "--generator.backend=transformers",
                *settings,
            ],
        )

    def wait_for_step(step, timeout_s=240):
        deadline = time.monotonic() + timeout_s
        while len(read_metrics(run_dir)) < step:
            assert procs["learner"].poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no step {step} within {timeout_s}s"
            time.sleep(0.05)  # real time: the learner process training

    rng = random.Random(0)
    try:
        start_learner(resume=False)
        start_generator(0)
        start_generator(1)
        for kill in range(3):
            # Past a checkpoint, at a random point between checkpoints.
            wait_for_step(5 * (kill + 1) + rng.randint(1, 4))
            procs["learner"].send_signal(signal.SIGKILL)
            procs["learner"].wait()
            if kill == 1:
                procs["gen-1"].send_signal(signal.SIGKILL)
                procs["gen-1"].wait()
                start_generator(1)
            start_learner(resume=True)
        assert procs["learner"].wait(timeout=400) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for name in ("gen-0", "gen-1"):
            assert procs[name].wait(timeout=60) == 0, (tmp_path / f"{name}.log").read_text()[-2000:]
        client = redis.Redis.from_url(server.url)
        remaining = {decode(fields[b"m"]).rollout_id for _, fields in client.xrange("asyncrl:ci-redis")}
        client.close()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        server.stop()

    consumed = [r["id"] for r in _lines(run_dir / "consumed.jsonl")]
    dropped = {r["id"]: r["reason"] for r in _lines(run_dir / "dropped.jsonl")}
    produced = set()
    for i in range(2):
        produced |= set((tmp_path / f"produced-{i}.txt").read_text().split())
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 61))
    assert len(consumed) == len(set(consumed)), "a rollout was trained twice"
    lost = produced - set(consumed) - set(dropped) - remaining
    assert not lost, f"{len(lost)} rollouts lost, e.g. {sorted(lost)[:5]}"
    assert len(consumed) >= 60 * 4 * 8 * 0.5
    assert set(dropped.values()) <= {"stale", "orphaned", "duplicate", "future_version"}
