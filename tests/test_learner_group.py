"""A 2-rank ZeRO-3 learner group on CPU (gloo), and checkpoint / resume of the real CLI."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.metrics import read_metrics
from conftest import ROOT, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests/zero3_worker.py"), str(ROOT / "assets/tiny-llama"), str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_holds_a_shard(group_results):
    for result in group_results:
        assert result["world"] == 2
        # Half of every parameter, rounded up per tensor: far less than the whole model.
        assert result["shard_numel"] < 0.51 * result["full_numel"]
        assert result["shard_numel"] >= 0.5 * result["full_numel"]


def test_loss_goes_down(group_results):
    for result in group_results:
        assert result["losses"][-1] < result["losses"][0] - 0.5


def test_export_is_the_full_model(group_results):
    rank0, rank1 = group_results
    assert rank0["initial_equals_checkpoint"]
    assert rank0["exported_sum"] == rank1["exported_sum"]  # both ranks gathered the same full tensors
    assert rank0["exported_sum"] != rank0["initial_sum"]
    assert rank0["export_logprob_diff"] < 1e-5


CONFIG = str(ROOT / "configs/ci-tiny.yaml")
SETTINGS = ["--staleness.max_staleness=0", "--learner.total_steps=30", "--learner.groups_per_step=4",
            "--learner.checkpoint_every_steps=10", "--generator.groups_per_request=4"]


def _start(args, log_path):
    return subprocess.Popen(args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT)


def _run(tmp_path, name, interrupt_at_step=None):
    """One learner and one generator; optionally SIGTERM the learner at a step and resume it."""
    run_dir = tmp_path / name
    ports = [f"--buffer.address=tcp://127.0.0.1:{free_port()}",
             f"--coordinator.address=tcp://127.0.0.1:{free_port()}"]
    learner_cmd = ["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *SETTINGS, *ports]
    generator = _start(["asyncrl-generator", CONFIG, "--generator-id", "gen-0", *SETTINGS, *ports],
                       tmp_path / f"{name}-gen.log")
    learner = _start(learner_cmd, tmp_path / f"{name}-learner.log")
    try:
        if interrupt_at_step is not None:
            deadline = time.monotonic() + 300
            while len(read_metrics(run_dir)) < interrupt_at_step and time.monotonic() < deadline:
                assert learner.poll() is None, (tmp_path / f"{name}-learner.log").read_text()[-3000:]
                time.sleep(0.05)
            learner.send_signal(signal.SIGTERM)
            assert learner.wait(timeout=120) == 0, (tmp_path / f"{name}-learner.log").read_text()[-3000:]
            stopped_at = len(read_metrics(run_dir))
            assert stopped_at < 30, "the learner stopped early on SIGTERM"
            assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == f"step{stopped_at:08d}"
            learner = _start([*learner_cmd, "--resume"], tmp_path / f"{name}-resumed.log")
        assert learner.wait(timeout=300) == 0, (tmp_path / f"{name}-learner.log").read_text()[-3000:]
        assert generator.wait(timeout=60) == 0
    finally:
        for proc in (learner, generator):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    records = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    return run_dir, [r for r in records if "staleness" in r]


def test_sigterm_and_resume_equals_an_uninterrupted_run(tmp_path):
    _, straight = _run(tmp_path, "straight")
    run_dir, resumed = _run(tmp_path, "resumed", interrupt_at_step=15)
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, 31)), "step and version numbering continue across the restart"
    assert [r["version"] for r in read_metrics(run_dir)] == steps
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)), "no rollout trained on twice"

    def group_and_sample(rollout_id):  # ids are SESSION-gN-i; each run has its own session
        return rollout_id.split("-", 1)[1]

    assert {group_and_sample(i) for i in ids} == {group_and_sample(r["id"]) for r in straight}
    assert Counter(r["prompt"] for r in resumed) == Counter(r["prompt"] for r in straight)
    assert all(r["staleness"] == 0 for r in resumed)

    # Any checkpoint exports as an HF folder; the last one equals the version published at that step.
    out = subprocess.run(["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), "--export", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    published = load_file(run_dir / "weights" / "v000030" / "model.safetensors")
    assert sorted(exported) == sorted(published)
    assert all(torch.equal(exported[k], published[k]) for k in exported)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == model.get_input_embeddings().weight.shape[0]
    bad = subprocess.run(["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), "--export", str(tmp_path / "x"),
                          "--tag", "step99999999"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "step99999999" in bad.stderr
