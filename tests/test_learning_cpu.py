"""A real learning curve on held-out data, on CPU: configs/copy-cpu.yaml as a user runs it.

The tiny model repeats held-out digit strings (never trained on) exactly only once it has learned to copy.
Half the config's 600 steps: on 2 CPU cores held-out pass@1 went 0.00 -> 0.96 on 100 strings in 300 steps (a
55-second run), where the whole config takes twice as long and learns nothing more that the check reads.
"""

import json

import pytest
from conftest import asyncrl_run

pytestmark = pytest.mark.slow


def test_held_out_accuracy_rises_on_a_dataset_with_the_math_reward(tmp_path):
    # The config as docs/getting-started/smollm2.md has a user run it, for 300 of its 600 steps.
    out = asyncrl_run("configs/copy-cpu.yaml", tmp_path / "run", "--learner.total_steps=300")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    evaluation = summary["eval"]
    assert evaluation["evaluations"] == 4 and evaluation["prompts"] == 100  # at the start, every 100 steps
    assert evaluation["pass@1_final"] >= evaluation["pass@1_start"] + 0.3, evaluation
    assert summary["reward_failures"] == {} and summary["task_rows_skipped"] == {}
