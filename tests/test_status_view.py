"""The human view of a status snapshot: drops and rejections by reason, and each generator's liveness."""

import re

from asyncrl.launch.status import format_status
from asyncrl.wire.protocol import GeneratorStatus, Status


def test_status_view_shows_drops_rejections_and_liveness():
    now = 1000.0
    gens = [
        GeneratorStatus(generator_id=name, weight_version=7, samples_generated=80, busy_s=2.0, last_seen_s=now - age)
        for name, age in (("fresh", 1.0), ("slow", 30.0), ("gone", 70.0))
    ]
    s = Status(
        step=5,
        total_steps=10,
        version=7,
        max_staleness=1,
        samples_consumed=40,
        samples_dropped={"stale": 3, "orphaned": 2},
        samples_admitted=50,
        buffer={"waiting": 4.0},
        generators=gens,
        rejected={"non_finite_reward": 1},
        generator_lease_s=60.0,
        started_s=now - 10,
        now_s=now,
    )
    view = format_status(s)
    assert "dropped {'stale': 3, 'orphaned': 2}" in view
    assert "rejected entries: {'non_finite_reward': 1}" in view
    lines = {line.split()[0]: line.split()[1] for line in view.splitlines() if line.startswith("  ")}
    assert lines == {"fresh": "alive", "slow": "quiet", "gone": "lost"}
    assert "40.0/s busy" in view
    # The learner's own rate over its training time: a resumed run's whole count over this process's uptime
    # (start-up included) read 34/s where it trained 2.7/s.
    assert "trained - samples/s (no step yet)" in view
    s.samples_per_s = 2.7
    assert "staleness bound 1  trained 2.7 samples/s" in format_status(s)
    assert "waiting for a batch: 4 samples, oldest -" in view
    s.buffer["oldest_waiting_staleness"] = 2.0
    assert "waiting for a batch: 4 samples, oldest 2 versions behind" in format_status(s)
    s.buffer.update(bytes=3514680.0, busy_s=0.123456)
    assert "bytes 3,514,680  busy_s 0.123" in format_status(s)  # was 3.51468e+06


def test_status_takes_a_run_folder_and_says_when_its_run_has_ended(tmp_path, capsys):
    from asyncrl.launch.cli import main
    from asyncrl.wire.ports import free_port

    run = tmp_path / "run"
    run.mkdir()
    assert main(["status", str(run)]) == 1
    assert f"{run} has no config.yaml (a run writes it as it starts)" in capsys.readouterr().err
    (run / "config.yaml").write_text(
        f"run_dir: {run}\ncoordinator: {{address: 'tcp://127.0.0.1:{free_port()}', timeout_s: 0.5, long_poll_s: 0.1}}\n"
    )
    assert main(["status", str(run)]) == 1
    assert (
        "is it running? A learner that listens beyond loopback answers only with the run's secret "
        "(--coordinator.curve_secret_file)"
    ) in capsys.readouterr().err
    (run / "summary.json").write_text("{}")
    assert main(["status", str(run)]) == 1
    assert re.search(
        rf"a run in {run} ended at \d{{4}}-\d\d-\d\d \d\d:\d\d: .*summary.json; if another runs there "
        r"now, check the address and coordinator.curve_secret_file",
        capsys.readouterr().err,
    )


def test_status_of_a_run_folder_refuses_another_runs_learner_at_its_address(tmp_path, capsys):
    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.server import CoordinatorServer
    from asyncrl.control.staleness import StalenessBound
    from asyncrl.launch.cli import main
    from asyncrl.wire.ports import free_port
    from asyncrl.wire.protocol import Status

    address = f"tcp://127.0.0.1:{free_port()}"
    (tmp_path / "config.yaml").write_text(
        f"run_dir: {tmp_path}\ncoordinator: {{address: '{address}', timeout_s: 5, run_id: ours}}\n"
    )
    status = Status(
        step=3, total_steps=9, version=3, max_staleness=1, samples_consumed=8, samples_dropped={},
        samples_admitted=8, buffer={}, generators=[], run_id="theirs",
    )  # fmt: skip
    coordinator = Coordinator(StalenessBound(1, 16), PromptCursor(10, 0), group_size=8, lease_s=60)
    server = CoordinatorServer(coordinator, address, lambda: status)
    try:
        assert main(["status", str(tmp_path)]) == 1
        assert f"the learner at {address} serves run theirs, not ours (coordinator.run_id)" in capsys.readouterr().err
        status.run_id = "ours"
        assert main(["status", str(tmp_path)]) == 0
        assert "step 3/9" in capsys.readouterr().out
    finally:
        server.close()


def test_status_watch_asks_again_while_the_learner_does_not_answer(tmp_path):
    import select
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    from asyncrl.wire.ports import free_port

    (tmp_path / "config.yaml").write_text(
        f"run_dir: {tmp_path}\ncoordinator: {{address: "
        f"'tcp://127.0.0.1:{free_port()}', timeout_s: 0.3, long_poll_s: 0.1}}\n"
    )
    watch = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch.cli", "status", str(tmp_path), "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines = []  # one per round that got no answer
    deadline = time.monotonic() + 60
    while len(lines) < 2:
        assert time.monotonic() < deadline, f"two rounds did not come within 60 s: {lines}"
        if select.select([watch.stdout], [], [], 1)[0]:
            line = watch.stdout.readline()
            assert line, f"the watch ended: {watch.communicate(timeout=30)[1][-2000:]}"
            lines.append(line)
    watch.send_signal(signal.SIGINT)
    _, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert all("no answer: " in line and "asking again (Ctrl-C to stop)" in line for line in lines), lines


def test_prometheus_leaves_out_the_reward_of_a_step_whose_every_reward_failed():
    from types import SimpleNamespace

    from asyncrl.config import load_config
    from learners.report import RunView

    coordinator = SimpleNamespace(bound=None, generator_list=lambda: [])
    view = RunView(load_config(None), SimpleNamespace(coordinator=coordinator), batcher=None, started_s=0.0)
    view._status = Status(
        step=3,
        total_steps=10,
        version=3,
        max_staleness=1,
        samples_consumed=24,
        samples_dropped={},
        samples_admitted=32,
        buffer={},
        generators=[],
    )
    view.last_record = {"reward": 0.5, "reward_failed": 2, "step_s": 0.1}
    values = {m.name: m.value for m in view.prometheus_metrics()}
    assert values["reward"] == 0.5 and values["reward_failed"] == 2
    view.last_record = {"reward": None, "reward_failed": 8, "step_s": 0.1}
    values = {m.name: m.value for m in view.prometheus_metrics()}
    assert "reward" not in values and values["reward_failed"] == 8 and values["step_seconds"] == 0.1
    view.last_record["samples_per_s"] = 9.0
    assert {m.name: m.value for m in view.prometheus_metrics()}["samples_per_s"] == 9.0
    counters = {m.name for m in view.prometheus_metrics() if m.counter}
    assert "samples_admitted" not in counters, "it goes down as slots are given back"
    assert {"coordinator_generator_samples", "coordinator_generator_weight_version"} <= values.keys(), (
        "named apart from each generator's own generator_samples, which a sum would count twice"
    )


def test_the_run_progress_bar_shows_a_step_without_a_reward():
    from tqdm import tqdm

    from asyncrl.launch.progress import update_bar

    record = {"step": 2, "version": 2, "staleness_mean": 0.5, "samples_per_s": 10.0}
    with tqdm(total=5, disable=True) as bar:  # disabled: it shows nothing and counts nothing, postfix aside
        update_bar(bar, {**record, "reward": None})
        assert bar.postfix.startswith("reward=failed")
        update_bar(bar, {**record, "step": 3, "reward": 0.25})
        assert bar.postfix.startswith("reward=0.250")
