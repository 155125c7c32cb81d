"""`asyncrl run --resume`: a run started by `asyncrl run` continues from its newest checkpoint, as one run;
a fresh run refuses a folder whose checkpoints it would neither continue nor keep."""

import json
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT, asyncrl_run

pytestmark = pytest.mark.slow


def checkpointed_run(run_dir, *extra):
    # The generator's backend is not what a resume is about: transformers starts sooner than vLLM on a CPU.
    settings = ("--learner.checkpoint_every_steps=2", "--generator.backend=transformers")
    return asyncrl_run("configs/ci-tiny.yaml", run_dir, *settings, *extra, timeout_s=300)


def test_a_run_resumes_from_its_checkpoint_as_one_run_and_a_fresh_run_refuses_its_folder(tmp_path):
    run_dir = tmp_path / "run"
    nothing = checkpointed_run(tmp_path / "empty", "--resume")
    assert nothing.returncode != 0 and "--resume: " in nothing.stderr and "has no checkpoint" in nothing.stderr
    first = checkpointed_run(run_dir, "--learner.total_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    again = checkpointed_run(run_dir, "--learner.total_steps=4")
    assert again.returncode != 0
    assert (
        "holds the checkpoints of an earlier run (newest: " in again.stderr and "--resume continues it" in again.stderr
    )
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4, "the refused run touched nothing"
    resumed = checkpointed_run(run_dir, "--learner.total_steps=6", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], "one record per step, the first four kept"
    summary = json.loads((run_dir / "summary.json").read_text())
    drops = Counter(json.loads(line)["reason"] for line in (run_dir / "dropped.jsonl").read_text().splitlines())
    assert summary["samples_dropped"] == dict(drops), "the whole run's drops, as dropped.jsonl lists them"
    fresh = sum(bucket.get("fresh", 0) for bucket in summary["staleness_by_length"].values())
    assert fresh >= summary["samples_consumed"], "every sample of the six steps, not only the last two's"
    assert "resum" in (run_dir / "logs/learner.log").read_text().lower()


def test_the_learner_asked_to_resume_a_folder_without_checkpoints_says_so_before_it_starts(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "learners.cli",
            str(ROOT / "configs/ci-tiny.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            "--resume",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"asyncrl-learner: --resume: {tmp_path / 'run'} has no checkpoint (no "
        "checkpoints/LATEST); a run writes them every learner.checkpoint_every_steps steps "
        "(0, the default: none)"
    )
    assert not (tmp_path / "run").exists(), "nothing written"


def test_a_fresh_learner_refuses_a_folder_with_an_earlier_runs_checkpoints_before_it_starts(tmp_path):
    """asyncrl-learner started by hand without --resume: it would neither continue nor keep them, and its own
    first checkpoint could land on the step the earlier run's LATEST names, which is never written over."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "LATEST").write_text("step00000002")
    out = subprocess.run(
        [sys.executable, "-m", "learners.cli", str(ROOT / "configs/ci-tiny.yaml"), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip().startswith(
        f"asyncrl-learner: {tmp_path / 'run'} holds the checkpoints of an earlier "
        "run (newest: step00000002): --resume continues it"
    ), out.stderr[-2000:]


def test_a_learner_stopped_before_its_first_step_leaves_no_checkpoint_to_block_the_next_run(tmp_path):
    """A run whose generators failed at start (a tokenizer that cannot encode the data, say) had its learner
    checkpoint step 0 on SIGTERM, and the corrected run was then refused the folder."""
    import signal
    import time

    from conftest import free_port, stop_process

    learner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "learners.cli",
            str(ROOT / "configs/ci-tiny.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            "--learner.checkpoint_every_steps=2",
            f"--buffer.address=tcp://127.0.0.1:{free_port()}",
            f"--coordinator.address=tcp://127.0.0.1:{free_port()}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        for line in learner.stdout:
            if "learner ready" in line or time.monotonic() > deadline:
                break
        learner.send_signal(signal.SIGTERM)
        learner.wait(timeout=60)
        assert learner.returncode == 0
    finally:
        stop_process(learner)
    assert (tmp_path / "run" / "config.yaml").exists(), "the learner had started"
    assert not (tmp_path / "run" / "checkpoints" / "LATEST").exists()
