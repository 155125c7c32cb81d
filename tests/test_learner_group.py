"""The learner group, end to end through the real CLI: 2 ZeRO-3 ranks on gloo, and checkpoint / resume."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from conftest import ONE_THREAD_EACH, ROOT, free_port
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.config import LoraConfig, load_config
from asyncrl.observe.metrics import read_metrics
from asyncrl.weights.adapters import saved_name, with_adapter

pytestmark = pytest.mark.slow

TWO_RANKS = str(ROOT / "configs/ci-2ranks.yaml")
TWO_RANKS_CONFIG = load_config(TWO_RANKS)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """`asyncrl run configs/ci-2ranks.yaml`: the real Learner under torchrun with 2 ranks (~15 s on 2 cores).

    The transformers backend is asked for by name: `auto` would pick vLLM wherever it is installed,
    and its log-probs are only close to the learner's, where transformers' are equal.
    """
    run_dir = tmp_path_factory.mktemp("two-ranks") / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            TWO_RANKS,
            "--run-dir",
            str(run_dir),
            "--free-ports",
            "--timeout-s",
            "400",
            "--generator.backend=transformers",
        ],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def test_two_ranks_complete_the_run_and_learn(two_ranks):
    total_steps = TWO_RANKS_CONFIG.learner.total_steps
    summary = json.loads((two_ranks / "summary.json").read_text())
    assert summary["learner_ranks"] == 2
    assert summary["steps"] == summary["version"] == total_steps
    records = read_metrics(two_ranks)
    assert [r["step"] for r in records] == list(range(1, total_steps + 1))
    # Measured over 4 runs: 0.069-0.071 over the first ten steps, 0.134-0.140 over the last ten.
    start = sum(r["reward"] for r in records[:10]) / 10
    end = sum(r["reward"] for r in records[-10:]) / 10
    assert end > start + 0.04, (start, end)
    consumed = _lines(two_ranks / "consumed.jsonl")
    ids = [c["id"] for c in consumed]
    assert len(set(ids)) == len(ids), "no rollout trained on twice"
    # transformers samples a whole group on one version, so every step trains on all of its groups.
    assert (
        len(ids)
        == summary["samples_consumed"]
        == total_steps * TWO_RANKS_CONFIG.learner.groups_per_step * TWO_RANKS_CONFIG.generator.samples_per_prompt
    )
    assert max(c["staleness"] for c in consumed) <= TWO_RANKS_CONFIG.staleness.max_staleness


def test_each_rank_stepped_its_own_half_of_the_model(two_ranks):
    """The last checkpoint holds one ZeRO-3 partition per rank, each half the model, each stepped every step."""
    import deepspeed  # noqa: F401  (the optimizer states pickle DeepSpeed types)

    total_steps = TWO_RANKS_CONFIG.learner.total_steps
    folder = two_ranks / "checkpoints" / (two_ranks / "checkpoints/LATEST").read_text().strip()
    assert folder.name == f"step{total_steps:08d}"
    full = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny-llama").parameters())
    for rank in range(2):
        states = torch.load(
            folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False
        )["optimizer_state_dict"]
        assert states["partition_count"] == 2
        shard = sum(t.numel() for t in states["fp32_flat_groups"])
        assert 0.5 * full <= shard < 0.51 * full, (rank, shard, full)
        adam = states["optimizer_state_dict"]["state"]
        assert [int(s["step"]) for s in adam.values()] == [total_steps] * len(adam)
        assert all(bool((s["exp_avg"] != 0).any()) for s in adam.values())
        assert (folder / f"rng_rank{rank}.safetensors").exists()


def test_the_ranks_shards_gather_into_the_model_generators_sample_from(two_ranks, tmp_path):
    """Published weights (gathered from both ranks at the last step) equal the checkpoint that DeepSpeed's
    zero_to_fp32 reassembles from both shards, and the partitioned forward matches the generator's model."""
    total_steps = TWO_RANKS_CONFIG.learner.total_steps
    out = subprocess.run(
        ["asyncrl-learner", TWO_RANKS, "--run-dir", str(two_ranks), "--export", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    published = load_file(two_ranks / "weights" / f"v{total_steps:06d}" / "model.safetensors")
    assert sorted(exported) == sorted(published)
    assert all(torch.equal(exported[k], published[k]) for k in exported)
    # At a step where every sample is fresh, the generator sampled with exactly the weights the learner
    # holds: its behaviour log-probs equal the learner's (transformers both sides), so the ratio is 1.
    fresh = [r for r in read_metrics(two_ranks) if r["staleness_max"] == 0]
    assert fresh and fresh[0]["step"] == 1
    assert max(r["approx_kl"] for r in fresh) < 1e-6 and all(r["clip_fraction"] == 0 for r in fresh)


CONFIG = str(ROOT / "configs/ci-tiny.yaml")
SETTINGS = [
    "--staleness.max_staleness=0",
    "--learner.total_steps=30",
    "--learner.groups_per_step=4",
    "--learner.checkpoint_every_steps=10",
    "--generator.groups_per_request=4",
    "--generator.backend=transformers",  # the learner's restart is the point; vLLM would only start slower
    *ONE_THREAD_EACH,
]


def _start(args, log_path):
    return subprocess.Popen(
        args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT
    )


def _run(tmp_path, name, interrupt_at_step=None):
    """One learner and one generator; optionally SIGTERM the learner at a step and resume it."""
    run_dir = tmp_path / name
    ports = [f"--buffer.address=tcp://127.0.0.1:{free_port()}", f"--coordinator.address=tcp://127.0.0.1:{free_port()}"]
    learner_cmd = ["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), *SETTINGS, *ports]
    generator = _start(
        ["asyncrl-generator", CONFIG, "--generator-id", "gen-0", *SETTINGS, *ports], tmp_path / f"{name}-gen.log"
    )
    learner = _start(learner_cmd, tmp_path / f"{name}-learner.log")
    try:
        if interrupt_at_step is not None:
            deadline = time.monotonic() + 300
            while len(read_metrics(run_dir)) < interrupt_at_step and time.monotonic() < deadline:
                assert learner.poll() is None, (tmp_path / f"{name}-learner.log").read_text()[-3000:]
                time.sleep(0.05)  # real time: the learner processes training
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
    walls = [r["wall_s"] for r in read_metrics(run_dir)]
    assert walls == sorted(walls) and walls[15] > walls[14], "the run's clock goes on from its checkpoint"
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)), "no rollout trained on twice"

    def group_and_sample(rollout_id):  # ids are SESSION-gN-i; each run has its own session
        return rollout_id.split("-", 1)[1]

    assert {group_and_sample(i) for i in ids} == {group_and_sample(r["id"]) for r in straight}
    assert Counter(r["prompt"] for r in resumed) == Counter(r["prompt"] for r in straight)
    assert all(r["staleness"] == 0 for r in resumed)

    # Any checkpoint exports as an HF folder; the last one equals the version published at that step.
    out = subprocess.run(
        ["asyncrl-learner", CONFIG, "--run-dir", str(run_dir), "--export", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    published = load_file(run_dir / "weights" / "v000030" / "model.safetensors")
    assert sorted(exported) == sorted(published)
    assert all(torch.equal(exported[k], published[k]) for k in exported)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == model.get_input_embeddings().weight.shape[0]
    bad = subprocess.run(
        [
            "asyncrl-learner",
            CONFIG,
            "--run-dir",
            str(run_dir),
            "--export",
            str(tmp_path / "x"),
            "--tag",
            "step99999999",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert bad.returncode != 0 and "step99999999" in bad.stderr


def test_a_stop_of_a_learner_group_checkpoints_on_every_rank_and_leaves_no_rank_running(tmp_path):
    """What `asyncrl run` does on Ctrl-C: SIGTERM to the learner command's process group. Rank 0 finishes its
    step and checkpoints with the other rank; the command ends once every rank has, and well."""
    import psutil

    run_dir = tmp_path / "run"
    ports = [f"--buffer.address=tcp://127.0.0.1:{free_port()}", f"--coordinator.address=tcp://127.0.0.1:{free_port()}"]
    settings = ["--learner.total_steps=1000", "--generator.backend=transformers", *ONE_THREAD_EACH, *ports]
    generator = _start(["asyncrl-generator", TWO_RANKS, "--generator-id", "gen-0", *settings], tmp_path / "gen.log")
    learner = subprocess.Popen(
        ["asyncrl-learner", TWO_RANKS, "--run-dir", str(run_dir), *settings],
        stdout=open(tmp_path / "learner.log", "w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=ROOT,
        start_new_session=True,  # its own group, as asyncrl run starts it
    )
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir)) < 3 and time.monotonic() < deadline:
            assert learner.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            time.sleep(0.05)  # real time: the ranks train
        ranks = psutil.Process(learner.pid).children(recursive=True)
        os.killpg(learner.pid, signal.SIGTERM)
        assert learner.wait(timeout=120) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        stopped_at = len(read_metrics(run_dir))
        assert 3 <= stopped_at < 1000
        assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == f"step{stopped_at:08d}"
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for proc in (learner, generator):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)


def test_two_zero3_ranks_train_a_lora_adapter_and_publish_it_gathered(tmp_path):
    """A LoRA learner of two ZeRO-3 ranks: each rank holds half of the base and of the adapter; what the
    generator loads is the whole adapter, gathered from both, as a PEFT folder."""
    run_dir = tmp_path / "run"
    lora = ["--learner.lora.rank=4", "--learner.lora.alpha=8", "--learner.lr=3e-3"]
    lora += ["--learner.checkpoint_every_steps=0", "--learner.total_steps=20"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.launch.cli", "run", TWO_RANKS, "--run-dir", str(run_dir), "--free-ports"]
        + ["--timeout-s", "400", "--generator.backend=transformers", *lora],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["learner_ranks"] == 2
    last = run_dir / "weights" / f"v{len(read_metrics(run_dir)):06d}"
    assert sorted(p.name for p in last.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    adapter = load_file(last / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in name or ".lora_B." in name for name in adapter), list(adapter)[:3]
    peft_model = with_adapter(AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny-llama"), LoraConfig(rank=4))
    shapes = {saved_name(name): tuple(p.shape) for name, p in peft_model.named_parameters() if p.requires_grad}
    assert {name: tuple(t.shape) for name, t in adapter.items()} == shapes, "whole tensors: both ranks' halves"
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name), "trained away from zero"
    # The generator loaded those gathered folders to the end (the last one or two may come after its final ask).
    steps, log = len(read_metrics(run_dir)), (run_dir / "logs" / "generator-0.log").read_text()
    assert any(f"loaded weights v{v} " in log for v in range(steps - 2, steps + 1)), log[-2000:]
