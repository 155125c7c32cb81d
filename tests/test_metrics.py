"""Run outputs users plot: a resumed run's records read as one run."""

import json
import logging

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.observe.metrics import MetricsWriter


def test_a_resumed_run_keeps_one_tensorboard_point_per_step(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(1, 11):
        writer.write({"step": step, "reward": 0.0})
    writer.resume_at(6)  # the checkpoint was at step 6: steps 7-10 are trained again
    for step in range(7, 11):
        writer.write({"step": step, "reward": 1.0})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("reward")]
    assert points == [(s, 0.0) for s in range(1, 7)] + [(s, 1.0) for s in range(7, 11)]


def test_the_newest_record_is_read_from_the_end_of_a_long_file(tmp_path):
    from asyncrl.observe.metrics import last_metrics

    assert last_metrics(tmp_path) is None
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 5001):
            f.write(json.dumps({"step": step, "reward": step / 5000, "note": "x" * 200}) + "\n")
        f.write('{"step": 5001, "rew')  # being written now
    assert last_metrics(tmp_path)["step"] == 5000
    assert last_metrics(tmp_path, tail_bytes=300)["step"] == 5000  # the cut first line is passed over


def test_a_diverged_steps_nan_and_infinity_are_written_as_null(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": float("nan"), "is_ratio_max": float("inf"), "reward": 0.5})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON")) == {
        "step": 1, "loss": None, "is_ratio_max": None, "reward": 0.5,
    }  # fmt: skip


def test_the_log_level_takes_any_case_and_numbers():
    from asyncrl.observe.logs import _level

    assert (_level("debug"), _level("Warning"), _level("10")) == (logging.DEBUG, logging.WARNING, 10)
    with pytest.warns(UserWarning, match="ASYNCRL_LOG_LEVEL='loud' is no log level"):
        assert _level("loud") == logging.INFO
