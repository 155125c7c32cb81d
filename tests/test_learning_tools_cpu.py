"""A model learns to use a tool, on CPU: configs/hint-cpu.yaml as a user runs it.

The tiny agent model must call the ``hint`` tool, then repeat what it returns: the prompt says nothing about the
answer, and a guess earns nothing. The config's own budget (``learner.max_train_s: 300``) bounds the run, here cut
to 1,200 of its 1,500 steps, and the run ends once 20 steps in a row average 0.75 (``learner.stop_at_reward``): far
above the 0.1 a call followed by a guess earns, so the model both calls and copies. Measured on 2 CPU cores at the
config's lr (5e-4): the mean reward of 20 steps passed 0.9 after 88-168 s of training in nine runs (546-1,164
steps; bench/README.md has runs beside TRL's) and 0.75 at steps 520-860 in the last five, but the last tenth can
take hundreds of steps (a digit copied as another), and one run in CI was still short of 0.85 at step 1,200 (best
0.82): the test does not bet on when that lifts.
"""

import json

import pytest
from conftest import accounted, asyncrl_run

# The config's time budget assumes the run has the machine to itself.
pytestmark = [pytest.mark.slow, pytest.mark.alone]


def test_the_tiny_model_learns_to_call_the_hint_tool_and_use_its_answer(tmp_path):
    run = tmp_path / "run"
    out = asyncrl_run("configs/hint-cpu.yaml", run, "--learner.total_steps=1200", "--learner.stop_at_reward=0.75")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [sum(s["reward"] for s in steps[i - 20 : i]) / 20 for i in range(20, len(steps) + 1)]
    assert steps[0]["reward"] < 0.1, steps[0]["reward"]
    # the target ended the run, at the first window that reached it
    assert len(steps) < 1200, max(windows)
    assert windows[-1] >= 0.75 > max(windows[:-1]), windows[-3:]
    log = (run / "logs" / "learner.log").read_text()
    assert f"the mean reward of the last 20 steps reached {windows[-1]:.3f} after {len(steps)} steps" in log
    last = steps[-20:]
    # the learned episodes: a call (a second one costs nothing, and some runs keep it: one settled on two calls
    # in every episode), then one answer, with the tool's reply masked out of the loss. With max_turns 3 an
    # episode that spends every turn calling ends unanswered, which a few do
    mean = {key: sum(s[key] for s in last) / len(last) for key in ("turns", "tool_calls", "masked_token_fraction")}
    assert 0.95 < mean["tool_calls"] < 2.05, mean
    assert 0.9 < mean["turns"] - mean["tool_calls"] < 1.05, mean  # each episode ends with one turn that answers
    assert 0.3 < mean["masked_token_fraction"] < 0.95, mean
    consumed = accounted(run)
    assert len(consumed) == sum(s["samples"] for s in steps)
