"""How the engine reads its workers' answers to a pushed or shared version (tensor parallel: one per worker)."""

import pytest

from generators.vllm_push import WeightsInDoubt, loaded_version

LOADED = {"version": 7, "bytes": 100}
TIMED_OUT = {"error": "weight push: timed out after 5s", "type": "TimeoutError", "in_doubt": False}
WRONG_SHAPE = {"error": "v7: wrong shape", "type": "ValueError", "in_doubt": False}
LOAD_FAILED = {"error": "CUDA error", "type": "RuntimeError", "in_doubt": True}


def test_every_worker_loaded_is_the_version():
    assert loaded_version([LOADED, LOADED]) == 7


@pytest.mark.parametrize(
    ("answers", "raised", "says"),
    [
        ([TIMED_OUT, TIMED_OUT], TimeoutError, "timed out"),  # nothing loaded anywhere: the old version serves
        ([WRONG_SHAPE], ValueError, "wrong shape"),
        ([{"error": "odd", "type": "KeyError", "in_doubt": False}], RuntimeError, "odd"),
    ],
)
def test_a_failure_no_worker_got_past_is_raised_as_the_worker_raised_it(answers, raised, says):
    with pytest.raises(raised, match=says) as caught:
        loaded_version(answers)
    assert not isinstance(caught.value, WeightsInDoubt)


@pytest.mark.parametrize(
    "answers",
    [
        [LOADED, TIMED_OUT],  # one worker of the engine loaded its shard of v7, the other did not receive it
        [TIMED_OUT, LOADED],
        [LOAD_FAILED],  # the loader failed part-way
        [LOAD_FAILED, TIMED_OUT],
    ],
)
def test_a_version_some_workers_loaded_or_failed_loading_leaves_the_weights_in_doubt(answers):
    with pytest.raises(WeightsInDoubt):
        loaded_version(answers)


def test_a_version_in_doubt_is_not_taken_for_one_overwritten_before_it_was_read():
    from asyncrl.weights.shared import superseded

    overwritten = {"error": "Superseded: v8 is being written", "type": "Superseded", "in_doubt": False}
    with pytest.raises(WeightsInDoubt) as caught:
        loaded_version([LOADED, overwritten])  # the engine went back to a folder: an error to log, not benign
    assert not superseded(caught.value)
