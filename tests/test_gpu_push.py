"""On two GPUs: a ZeRO-3 learner rank pushes over NCCL into a running vLLM engine (needs vLLM and DeepSpeed)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_nccl_push_lands_whole_in_the_engine(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "push.json"
    run = subprocess.run(
        [
            sys.executable,
            "bench/push_bench.py",
            "--models",
            "tiny",
            "--batch",
            "8",
            "--rounds",
            "1",
            "--reps",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())["models"]["tiny"]
    assert result["push"]["weights_match"], result["push"]["checksums"]
    assert result["samples_after_push_ok"]
