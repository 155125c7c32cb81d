"""A run trained against a reward model served over HTTP: examples/reward_server.py as a real process."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import ROOT, asyncrl_run, free_port, stop_process

pytestmark = pytest.mark.slow

SERVER = ROOT / "examples" / "reward_server.py"
STEPS = 20


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
        return json.loads(reply.read())


def test_a_run_trains_on_scores_from_a_reward_server(tmp_path):
    model_dir = tmp_path / "tiny-rm"
    subprocess.run(
        [sys.executable, str(SERVER), "--make-tiny-model", str(model_dir)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, str(SERVER), "--model", str(model_dir), "--port", str(port), "--max-batch-size", "64"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 120  # real time: another process loads a model, however long that takes here
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                health(port)
                break
            except OSError:
                time.sleep(0.2)  # not listening yet: ask again
        run_dir = tmp_path / "run"
        out = asyncrl_run(
            "configs/ci-tiny.yaml",
            run_dir,
            f"--learner.total_steps={STEPS}",
            f"--task.reward=http://127.0.0.1:{port}/score",
            "--generator.backend=transformers",  # the reward's path is the point; it starts sooner than vLLM
            timeout_s=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        served = health(port)
    finally:
        stop_process(server)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in records if "reward" in r]
    assert len(rewards) == STEPS
    assert len(set(rewards)) > 1, "the model scores different responses differently"
    samples_per_step = 16 * 8  # ci-tiny: learner.groups_per_step x generator.samples_per_prompt
    assert served["samples"] >= STEPS * samples_per_step, "every trained sample was scored by the server"
    assert served["requests"] * 8 == served["samples"], "one request per group of 8 samples"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and not summary.get("reward_failures"), summary.get("reward_failures")
