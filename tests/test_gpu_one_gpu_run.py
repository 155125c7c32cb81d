"""On one GPU: a vLLM generator (CUDA graphs, bf16) and the learner share the device through a real run,
versions handed over through CUDA IPC, no folder written; and the same under CUDA MPS (``mps.enabled``)."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

from asyncrl.observe.metrics import read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("liger, mps", [("auto", False), ("false", False), ("false", True)])
def test_generator_and_learner_share_one_gpu_and_every_version_reaches_the_generator(tmp_path, liger, mps):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if liger == "auto":
        pytest.importorskip("liger_kernel")
    if mps and shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("no nvidia-cuda-mps-control on this machine (it comes with the NVIDIA driver's utilities)")
    if not (ROOT / "models/smollm2-135m/config.json").exists():
        pytest.skip("asyncrl model import smollm2-135m models/smollm2-135m first")
    steps = 6
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            "configs/arith-smollm2.yaml",
            "--run-dir",
            str(tmp_path),
            "--free-ports",
            "--timeout-s",
            "900",
            f"--learner.total_steps={steps}",
            "--learner.max_train_s=0",
            "--eval.every_steps=0",
            "--model.dtype=auto",
            "--generator.vllm.enforce_eager=null",
            "--generator.vllm.enable_prefix_caching=null",
            "--generator.vllm.kv_cache_memory_bytes=null",
            "--generator.vllm.gpu_memory_utilization=0.3",
            "--generator.max_new_tokens=64",
            f"--learner.liger_kernels={liger}",
            f"--mps.enabled={str(mps).lower()}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1000,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples_consumed"] == steps * 128
    assert summary["samples_dropped"] == {}
    if mps:  # the learner and the generator's engine (its core process too) were the run's daemon's clients
        assert summary["mps"]["clients_seen"] >= 2, summary["mps"]
    generator_log = (tmp_path / "logs/generator-0.log").read_text()
    assert "dtype=torch.bfloat16" in generator_log and "enforce_eager=False" in generator_log
    assert f"loaded weights v{steps}" in generator_log or f"loaded weights v{steps - 1}" in generator_log
    assert "failed" not in generator_log
    # vLLM sized the KV cache from its 0.3 of the GPU: far more than the 1 GiB a CPU gets
    config = json.loads((ROOT / "models/smollm2-135m/config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    kv_tokens = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", generator_log).group(1).replace(",", ""))
    assert kv_tokens * bytes_per_token > 8 << 30, kv_tokens
    assert not (tmp_path / "weights").exists()  # shared weights: no folder was written
    assert max(r["staleness_max"] for r in read_metrics(tmp_path)) <= 1  # the config's bound
    learner_log = (tmp_path / "logs/learner.log").read_text()
    assert ("Liger's kernels in the policy (llama)" in learner_log) == (liger == "auto")  # on where it can be
    assert "learner.pack_sequences auto: packed rows under varlen attention" in learner_log  # the GPU default
    # Left to the interpreter's teardown, the learner could wait forever after its last line (seen on an H200).
    assert "learner shut down" in learner_log
