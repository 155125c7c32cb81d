"""The real entrypoints as subprocesses, on a tiny config, end to end."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from conftest import ROOT, free_port

CONFIG = str(ROOT / "configs/ci-tiny.yaml")
pytestmark = pytest.mark.slow


def _ports() -> list[str]:
    return [f"--buffer.address=tcp://127.0.0.1:{free_port()}", f"--coordinator.address=tcp://127.0.0.1:{free_port()}"]


def _consumed(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_separate_learner_and_generators_learn_within_the_bound(tmp_path):
    """asyncrl-learner and two asyncrl-generator processes, started as a user would on separate
    machines: weights travel over ZeroMQ, not through a shared folder."""
    ports = _ports() + [f"--coordinator.weights_address=tcp://127.0.0.1:{free_port()}"]
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    learner = subprocess.Popen(["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *ports],
                               stdout=open(tmp_path / "learner.log", "w"), stderr=subprocess.STDOUT, env=env)
    generators = [
        subprocess.Popen(["asyncrl-generator", CONFIG, "--generator-id", f"gen-{i}", *ports],
                         stdout=open(tmp_path / f"gen-{i}.log", "w"), stderr=subprocess.STDOUT, env=env)
        for i in range(2)
    ]
    try:
        assert learner.wait(timeout=400) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for g in generators:
            assert g.wait(timeout=60) == 0, "generators exit cleanly once the learner is done"
    finally:
        for p in [learner, *generators]:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
    records = read_metrics(run_dir)
    assert len(records) == 200
    start, end = _mean(r["reward"] for r in records[:20]), _mean(r["reward"] for r in records[-20:])
    assert end > start + 0.15, (start, end)
    consumed = [c for c in _consumed(run_dir) if "staleness" in c]
    assert consumed and max(c["staleness"] for c in consumed) <= 2
    assert len({c["id"] for c in consumed}) == len(consumed), "no rollout trained on twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_consumed"] == len(consumed)
    assert {c["generator"] for c in consumed} == {"gen-0", "gen-1"}, "both generators fed the learner"
    assert max(c["staleness"] for c in consumed) >= 0 and records[-1]["version"] == 200
    gen_log = (tmp_path / "gen-0.log").read_text()
    assert "loaded weights v199" in gen_log or "loaded weights v200" in gen_log, gen_log[-2000:]
    for name in ("config.yaml", "metrics.jsonl", "reward.png"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").iterdir())


def test_asyncrl_run_compares_against_synchronous_training(tmp_path):
    """`asyncrl run --compare-sync`: the same pipeline with max_staleness=0 is exactly on-policy."""
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", CONFIG, "--run-dir", str(tmp_path), "--compare-sync",
         "--free-ports", "--timeout-s", "400", "--learner.total_steps=40"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "async / sync speedup" in out.stdout
    sync_consumed = [c for c in _consumed(tmp_path / "sync") if "staleness" in c]
    assert len(sync_consumed) == 40 * 16 * 8
    assert all(c["staleness"] == 0 for c in sync_consumed)
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["sync"]["max_staleness"] == 0 and result["async"]["max_staleness"] == 2
    assert result["speedup_samples_per_s"] > 0
    assert 0 < result["async"]["pipeline_efficiency"] <= 1.5
    assert (tmp_path / "compare.png").exists()


def test_asyncrl_run_pushes_weights_into_two_generators(tmp_path):
    """push.address: every version goes from learner rank 0 straight into both generators' engines
    over one process group (gloo here, NCCL on GPU); no weight folder is written."""
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", CONFIG, "--run-dir", str(tmp_path), "--free-ports",
         "--timeout-s", "400", "--learner.total_steps=60", "--generator.replicas=2",
         "--push.address=127.0.0.1:1", "--push.generators=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    learner_log = (tmp_path / "logs/learner.log").read_text()
    assert learner_log.count("pushed v") == 60 and "push v" not in learner_log.replace("pushed v", "")
    for i in range(2):
        log = (tmp_path / f"logs/generator-{i}.log").read_text()
        assert "loaded weights v60" in log or "loaded weights v59" in log, log[-2000:]
    assert not (tmp_path / "weights").exists()
    consumed = [c for c in _consumed(tmp_path) if "staleness" in c]
    assert consumed and max(c["staleness"] for c in consumed) <= 2
    records = read_metrics(tmp_path)
    assert _mean(r["reward"] for r in records[-10:]) > _mean(r["reward"] for r in records[:10])
    # Pushes run in the background: the step only pays for the gather, and each push's time is logged.
    assert sum("push_s" in r for r in records) >= 50 and all(r["push_s"] > 0 for r in records if "push_s" in r)


def test_a_restarted_generator_gets_pushed_weights(tmp_path):
    """With push, a generator that starts after a version went out gets it pushed again: the learner
    notices it lacks the latest weights while waiting for rollouts and re-sends its kept copy."""
    ports = _ports() + [f"--push.address=127.0.0.1:{free_port()}", "--push.generators=1", "--push.timeout_s=5",
                        "--coordinator.generator_lease_s=5", "--learner.total_steps=40"]
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def generator(name):
        return subprocess.Popen(["asyncrl-generator", CONFIG, "--generator-id", name, *ports],
                                stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=env)

    learner = subprocess.Popen(["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *ports],
                               stdout=open(tmp_path / "learner.log", "w"), stderr=subprocess.STDOUT, env=env)
    first = generator("gen-a")
    second = None
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir)) < 10:
            assert time.monotonic() < deadline and learner.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            time.sleep(0.1)
        first.kill()
        first.wait()
        second = generator("gen-b")
        assert learner.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert second.wait(timeout=60) == 0
    finally:
        for p in (learner, first, second):
            if p is not None and p.poll() is None:
                p.kill()
    assert len(read_metrics(run_dir)) == 40
    # Depending on when the first generator died, the push in flight is retried under a new epoch,
    # or the learner sees the new generator lacking the latest version and pushes it again.
    learner_log = (tmp_path / "learner.log").read_text()
    assert "pushing it again" in learner_log or "generators keep their version" in learner_log
    assert "loaded weights v" in (tmp_path / "gen-b.log").read_text()
    consumed = [c for c in _consumed(run_dir) if "staleness" in c]
    assert {c["generator"] for c in consumed} == {"gen-a", "gen-b"}
    assert max(c["staleness"] for c in consumed) <= 2
