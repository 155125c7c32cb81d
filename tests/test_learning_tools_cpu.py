"""A model learns to use a tool, on CPU: configs/hint-cpu.yaml as a user runs it.

The tiny agent model must call the ``hint`` tool, then repeat what it returns: the prompt says nothing about the
answer, and a guess earns nothing. The config's own budget (``learner.max_train_s: 300``) bounds the run.
Measured on 2 CPU cores: the mean reward of 20 steps passed 0.9 after 129 s of training (step ~840).
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, accounted

pytestmark = pytest.mark.slow


def test_the_tiny_model_learns_to_call_the_hint_tool_and_use_its_answer(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            str(ROOT / "configs/hint-cpu.yaml"),
            "--run-dir",
            str(run),
            "--free-ports",
            "--timeout-s",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=700,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [sum(s["reward"] for s in steps[i - 20 : i]) / 20 for i in range(20, len(steps) + 1)]
    assert steps[0]["reward"] < 0.1, steps[0]["reward"]
    assert max(windows) >= 0.9, max(windows)  # the mean reward of 20 steps in a row, within the 5-minute budget
    last = steps[-20:]
    assert windows[-1] >= 0.8, windows[-1]  # and it stays there
    # the learned episodes: one call, then the answer, with the tool's reply masked out of the loss
    assert all(s["turns"] < 2.2 and s["tool_calls"] >= 1 for s in last)
    assert all(0.3 < s["masked_token_fraction"] < 0.95 for s in last)
    consumed = accounted(run)
    assert len(consumed) == sum(s["samples"] for s in steps)
