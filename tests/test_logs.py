"""StallReport: work that runs past its limit logs where every thread is, once."""

import logging
import threading
import time

from asyncrl.logs import StallReport


def _slow_step(seconds: float) -> None:
    time.sleep(seconds)


def test_work_past_the_limit_logs_every_threads_stack_once(caplog):
    report = StallReport(0.1, logging.getLogger("test"), "learner.stall_report_s")
    helper = threading.Thread(target=_slow_step, args=(1.0,), name="busy-helper", daemon=True)
    helper.start()
    with caplog.at_level(logging.WARNING, logger="test"):
        with report.watch("learner step 7"):
            _slow_step(0.5)
        with report.watch("learner step 8"):  # once: the first report is the one that says where it waits
            _slow_step(0.3)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert text.startswith("learner step 7 has run for 0 s") and "learner.stall_report_s" in text
    assert "thread MainThread:" in text and "thread busy-helper:" in text
    assert text.count("in _slow_step") == 2  # the stuck line of both threads


def test_work_within_the_limit_or_with_the_report_off_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="test"):
        with StallReport(0.3, logging.getLogger("test"), "x").watch("quick"):
            _slow_step(0.01)
        with StallReport(0, logging.getLogger("test"), "x").watch("off"):
            _slow_step(0.2)
        time.sleep(0.4)  # past the first limit: the cancelled timer stays quiet
    assert caplog.records == []
