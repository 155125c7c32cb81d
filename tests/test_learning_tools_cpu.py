"""A model learns to use a tool, on CPU: configs/hint-cpu.yaml as a user runs it.

The tiny agent model must call the ``hint`` tool, then repeat what it returns: the prompt says nothing about the
answer, and a guess earns nothing. The config's own budget (``learner.max_train_s: 300``) bounds the run.
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
    last = steps[-20:]
    reward = sum(s["reward"] for s in last) / len(last)
    assert steps[0]["reward"] < 0.1 and reward >= 0.9, (steps[0]["reward"], reward)
    # the learned episodes: one call, then the answer, with the tool's reply masked out of the loss
    assert all(s["turns"] < 2.2 and s["tool_calls"] >= 1 for s in last)
    assert all(0.3 < s["masked_token_fraction"] < 0.95 for s in last)
    consumed = accounted(run)
    assert len(consumed) == sum(s["samples"] for s in steps)
