"""A LoRA adapter learns the quickstart task on CPU: configs/quickstart-lora.yaml as a user runs it, then exported.

The learner trains only the adapter; every version the generator loads is a
PEFT adapter folder; ``--export`` writes the adapter, ``--export --merged`` the
base with it merged in, and both load with peft and transformers as they are.
"""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, accounted, asyncrl_run
from peft import PeftModel
from transformers import AutoModelForCausalLM

from asyncrl.weights.adapters import ADAPTER_CONFIG, ADAPTER_FILE

# How fast these runs learn per step depends on the generator keeping pace with the learner (the quickstart bounds
# staleness), which a test beside them on the same cores upsets: one such run stayed under 0.9 for 600 steps.
pytestmark = [pytest.mark.slow, pytest.mark.alone]
CONFIG = "configs/quickstart-lora.yaml"


def export(run, out, *flags):
    command = [sys.executable, "-m", "learners.cli", str(ROOT / CONFIG), "--run-dir", str(run), "--export", str(out)]
    done = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_quickstart_learns_with_a_lora_adapter_and_exports_it(tmp_path):
    run = tmp_path / "run"
    out = asyncrl_run(CONFIG, run, "--learner.stop_at_reward=0.9")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [sum(s["reward"] for s in steps[i - 20 : i]) / 20 for i in range(20, len(steps) + 1)]
    assert steps[0]["reward"] < 0.3, steps[0]["reward"]
    # The config's run is the same every time on one machine, not from one CPU to another: on some its 20-step
    # mean reached 0.9 at step 241 (where the run stops); on an AVX-512 Xeon it rose to 0.5 by step 137 and
    # levelled off at 0.82, its policy near-deterministic and wrong on some digits. Its base scores 0.08.
    assert max(windows) >= 0.6, (len(steps), max(windows))
    assert len(accounted(run)) == sum(s["samples"] for s in steps)

    # what travelled to the generator: adapter folders, a fraction of the model's bytes
    versions = sorted((run / "weights").glob("v[0-9]*"))
    assert versions and all(sorted(p.name for p in v.iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE] for v in versions)
    model_bytes = (ROOT / "assets/tiny-llama/model.safetensors").stat().st_size
    assert (versions[-1] / ADAPTER_FILE).stat().st_size < model_bytes / 4

    export(run, tmp_path / "adapter")
    export(run, tmp_path / "merged", "--merged")
    base = AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny-llama")
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([[1, 5, 6, 7, 13, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4)
        with adapted.disable_adapter():
            plain = adapted(input_ids=ids).logits
        assert not torch.allclose(merged(input_ids=ids).logits, plain, atol=1e-2)  # it learned something
    # the last published version is the exported adapter
    final = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny-llama"), versions[-1])
    with torch.no_grad():
        assert torch.allclose(final.eval()(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)


def test_a_lora_run_with_a_kl_penalty_measures_it_against_the_base_and_shares_weights_in_memory(tmp_path):
    """The reference is the policy with its adapter off: the KL is 0 while the adapter is (version 0), then
    grows as it trains; versions reach the generator through shared memory, as they would on one GPU."""
    run = tmp_path / "run"
    overrides = ["--algo.kl_coef=0.05", "--learner.shared_weights=true", "--learner.total_steps=200"]
    out = asyncrl_run(CONFIG, run, *overrides, "--learner.checkpoint_every_steps=0")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["kl_ref"] > 0.05 and steps[-1]["reward"] > 0.5, steps[-1]
    assert not (run / "weights").exists() or not any((run / "weights").glob("v[0-9]*"))  # none went to disk
