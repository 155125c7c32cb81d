"""The real entrypoints as subprocesses, on a tiny config, end to end."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ONE_THREAD_EACH, ROOT, accounted, asyncrl_run, free_port, loopback_ports, wait_for

from asyncrl.observe.metrics import read_metrics

CONFIG = str(ROOT / "configs/ci-tiny.yaml")
pytestmark = pytest.mark.slow


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _consumed(run_dir: Path) -> list[dict]:
    return _lines(run_dir / "consumed.jsonl")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_separate_learner_and_generators_learn_within_the_bound(tmp_path):
    """asyncrl-learner and two asyncrl-generator processes, started as a user would on separate
    machines: weights travel over ZeroMQ, not through a shared folder, into a vLLM engine (gen-0)
    and the transformers backend (gen-1)."""
    ports = loopback_ports() + [f"--coordinator.weights_address=tcp://127.0.0.1:{free_port()}", *ONE_THREAD_EACH]
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The generators first, as a user may start them: each waits for the learner once its engine is up, so a
    # slow engine start (vLLM's, on a loaded machine) does not miss a short run.
    generators = [
        subprocess.Popen(
            ["asyncrl-generator", CONFIG, "--generator-id", f"gen-{i}", f"--generator.backend={backend}", *ports],
            stdout=open(tmp_path / f"gen-{i}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i, backend in enumerate(["vllm", "transformers"])
    ]
    learner = None
    try:
        for i, g in enumerate(generators):
            log = tmp_path / f"gen-{i}.log"
            wait_for(lambda g=g, log=log: "waiting for the learner" in log.read_text() or g.poll() is not None, 300)
            assert g.poll() is None, log.read_text()[-3000:]
        learner = subprocess.Popen(
            ["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *ports],
            stdout=open(tmp_path / "learner.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        assert learner.wait(timeout=400) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for g in generators:
            assert g.wait(timeout=60) == 0, "generators exit cleanly once the learner is done"
    finally:
        for p in [learner, *generators]:
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
    records = read_metrics(run_dir)
    assert len(records) == 200
    start, end = _mean(r["reward"] for r in records[:20]), _mean(r["reward"] for r in records[-20:])
    assert end > start + 0.15, (start, end)
    consumed = accounted(run_dir)
    assert max(c["staleness"] for c in consumed) <= 2
    # An asynchronous run: samples were trained on one or two versions old, so the bound was reached.
    assert any(c["staleness"] > 0 for c in consumed)
    assert {c["generator"] for c in consumed} == {"gen-0", "gen-1"}, "both generators fed the learner"
    assert records[-1]["version"] == 200
    gen_log = (tmp_path / "gen-0.log").read_text()
    # it followed the learner to the end: the last version it loaded is within the staleness bound of the last
    assert any(f"loaded weights v{v} " in gen_log for v in range(197, 201)), gen_log[-2000:]
    for name in ("config.yaml", "metrics.jsonl", "reward.png"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").iterdir())


def _overlap_s(run_dir: Path) -> tuple[float, float]:
    """From a run's trace: seconds in which a generator generated while the learner trained (forward,
    backward or optimizer step), and the learner's training seconds."""
    events = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]

    def merged(names):  # one process's spans never overlap, but two generators' may: merge them
        out: list[list[float]] = []
        for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in names):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    generating, training = merged({"generate"}), merged({"forward", "backward", "optimizer_step"})
    both = sum(max(0.0, min(g[1], t[1]) - max(g[0], t[0])) for g in generating for t in training)
    return both / 1e6, sum(t[1] - t[0] for t in training) / 1e6


def test_asyncrl_run_compares_against_synchronous_training(tmp_path):
    """`asyncrl run --compare-sync`: the same pipeline with max_staleness=0 is exactly on-policy, and its
    generator and learner take turns, where the asynchronous run's work at once.

    The transformers backend is asked for by name: `auto` picks vLLM wherever it is installed,
    and this is the run that keeps the reference backend tested end to end.
    """
    steps, samples_per_step = 60, 16 * 8
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        tmp_path,
        "--compare-sync",
        f"--learner.total_steps={steps}",
        "--generator.backend=transformers",
        "--trace",
        timeout_s=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "async / sync speedup" in out.stdout
    result = json.loads((tmp_path / "compare.json").read_text())
    a, s = result["async"], result["sync"]
    assert a["max_staleness"] == 2 and s["max_staleness"] == 0
    # transformers samples a whole group on one version, so groups are trained on whole: exact counts.
    sync_consumed, async_consumed = accounted(tmp_path / "sync"), accounted(tmp_path / "async")
    assert len(sync_consumed) == len(async_consumed) == steps * samples_per_step
    assert all(c["staleness"] == 0 for c in sync_consumed)
    assert s["samples_dropped"] == {}, "sync admits one version's samples at a time: none can go stale"
    assert max(c["staleness"] for c in async_consumed) <= 2 and any(c["staleness"] > 0 for c in async_consumed)
    # compare.json's speedup is the ratio of the two runs' own throughputs.
    throughput = {label: r["samples_consumed"] / r["wall_s"] for label, r in (("async", a), ("sync", s))}
    assert result["speedup_samples_per_s"] == pytest.approx(throughput["async"] / throughput["sync"])
    # Async is faster because generation and training overlap (how much faster is measured by bench/e2e.py):
    # here, from the timelines, the sync learner never trains while a generator generates, and the async
    # one for a good part of its training time (44% in one run on 2 cores; how much depends on which side
    # is faster).
    sync_overlap_s, sync_training_s = _overlap_s(tmp_path / "sync")
    async_overlap_s, async_training_s = _overlap_s(tmp_path / "async")
    assert sync_training_s > 0 and async_training_s > 0
    assert sync_overlap_s < 0.01 * sync_training_s, (sync_overlap_s, sync_training_s)
    assert async_overlap_s > 0.2 * async_training_s, (async_overlap_s, async_training_s)
    assert (tmp_path / "compare.png").exists()


def test_asyncrl_run_pushes_weights_into_two_generators(tmp_path):
    """push.address: every version goes from learner rank 0 straight into both generators' engines
    over one process group (gloo here, NCCL on GPU); no weight folder is written."""
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        tmp_path,
        "--learner.total_steps=60",
        "--generator.replicas=2",
        "--push.address=127.0.0.1:1",
        "--push.generators=2",
        timeout_s=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    learner_log = (tmp_path / "logs/learner.log").read_text()
    assert learner_log.count("pushed v") == 60 and "push v" not in learner_log.replace("pushed v", "")
    assert "learner shut down" in learner_log  # its process groups torn down before the interpreter's teardown
    for i in range(2):
        log = (tmp_path / f"logs/generator-{i}.log").read_text()
        assert "loaded weights v60" in log or "loaded weights v59" in log, log[-2000:]
    assert not (tmp_path / "weights").exists()
    # The rendezvous store listens on every interface: the run keyed it with a secret only its user can read.
    assert (tmp_path / "push.secret").stat().st_mode & 0o777 == 0o600
    consumed = accounted(tmp_path)
    assert max(c["staleness"] for c in consumed) <= 2
    records = read_metrics(tmp_path)
    # Weights that arrive by push are the ones that learn: measured 0.071 over the first ten steps, 0.189
    # over the last ten.
    start, end = _mean(r["reward"] for r in records[:10]), _mean(r["reward"] for r in records[-10:])
    assert end > start + 0.05, (start, end)
    # Pushes run in the background; metrics' push_s is the duration of a push that completed, as logged.
    pushed = set(re.findall(r"pushed v\d+: .* ([0-9.]+) s$", learner_log, re.MULTILINE))
    timed = [f"{r['push_s']:.3f}" for r in records if "push_s" in r]
    assert len(timed) >= 50 and set(timed) <= pushed


def test_asyncrl_run_hands_weights_over_in_shared_memory(tmp_path):
    """learner.shared_weights: every version is written into one shared-memory segment (a /dev/shm file
    here, CUDA IPC on one GPU) and both generators copy it from there; no weight folder is written."""
    segments_before = set(Path("/dev/shm").glob("asyncrl-weights-*"))
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        tmp_path,
        "--learner.total_steps=60",
        "--generator.replicas=2",
        "--learner.shared_weights=true",
        timeout_s=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for i in range(2):
        log = (tmp_path / f"logs/generator-{i}.log").read_text()
        # A generator copies the newest version when it asks for work, so how many it loads depends on its
        # pace (25 of 60 in one CI run, up to 60 in others), and one still generating when
        # the learner finishes misses the last versions (v57 of 60 in 1 of 4 runs).
        loaded = [int(v) for v in re.findall(r"loaded weights v(\d+)", log)]
        # (a generator whose start was slowest on a loaded CI machine loaded 4: it copies as it asks for work)
        assert len(loaded) >= 3 and loaded == sorted(loaded) and loaded[-1] >= 55, log[-2000:]
        assert "failed" not in log, log[-2000:]
    assert not (tmp_path / "weights").exists()
    assert set(Path("/dev/shm").glob("asyncrl-weights-*")) <= segments_before  # the learner removed its own
    consumed = accounted(tmp_path)
    assert max(c["staleness"] for c in consumed) <= 2
    records = read_metrics(tmp_path)
    start, end = _mean(r["reward"] for r in records[:10]), _mean(r["reward"] for r in records[-10:])
    assert end > start + 0.05, (start, end)


def test_a_step_past_learner_stall_report_s_logs_the_learners_stacks(tmp_path):
    """A learner step that runs longer than learner.stall_report_s says in the log where each thread is."""
    out = asyncrl_run(
        "configs/ci-tiny.yaml", tmp_path, "--learner.total_steps=3", "--learner.stall_report_s=0.001", timeout_s=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "logs/learner.log").read_text()
    assert re.search(r"learner step 1 still running after \d+ s \(learner.stall_report_s\)", log), log[-3000:]
    report = log[log.index("learner step 1 still running") : log.index("learner step 1 finished after")]
    assert "thread MainThread:" in report and "learners/trainer.py" in report, report[-3000:]


def test_a_restarted_generator_gets_pushed_weights(tmp_path):
    """With push, a generator that starts after a version went out gets it pushed again: the learner
    notices it lacks the latest weights while waiting for rollouts and re-sends its kept copy."""
    (tmp_path / "push.secret").write_text("shared by the learner and its generators\n")
    ports = loopback_ports() + [
        f"--push.address=127.0.0.1:{free_port()}",
        f"--push.secret_file={tmp_path / 'push.secret'}",
        "--push.generators=1",
        "--push.timeout_s=5",
        "--coordinator.generator_lease_s=5",
        "--learner.total_steps=40",
        *ONE_THREAD_EACH,
    ]
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def generator(name):
        return subprocess.Popen(
            ["asyncrl-generator", CONFIG, "--generator-id", name, *ports],
            stdout=open(tmp_path / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )

    learner = subprocess.Popen(
        ["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *ports],
        stdout=open(tmp_path / "learner.log", "w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    first = generator("gen-a")
    second = None
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir)) < 10:
            assert time.monotonic() < deadline and learner.poll() is None, (tmp_path / "learner.log").read_text()[
                -3000:
            ]
            time.sleep(0.1)  # real time: the learner process training
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
    consumed = _consumed(run_dir)
    assert {c["generator"] for c in consumed} == {"gen-a", "gen-b"}
    assert max(c["staleness"] for c in consumed) <= 2
