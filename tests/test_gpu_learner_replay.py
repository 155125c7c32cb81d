"""On a GPU, the learner's bf16 steps (DeepSpeed's bf16 optimizer around fp32 master weights) are the steps
of a plain loop that trains as transformers' Trainer does with ``bf16=True``: fp32 weights, the forward and
backward passes under bf16 autocast, torch's AdamW, on the batches the run logged (see test_learner_replay.py).

A published version is the bf16 rounding of the master weights, so the plain loop's weights are rounded the
same way before they are compared: over four steps, the direction and the size of the learner's update from
the start must be the plain loop's. A step that the 16-bit optimizer scaled, skipped or clipped apart from the
plain loop would move the size; a different gradient would move the direction.
"""

import json

import pytest
from conftest import asyncrl_run
from test_learner_replay import STEPS, replay

pytestmark = pytest.mark.gpu


def test_the_bf16_learner_takes_an_autocast_adamw_loops_steps_on_its_own_batches(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.config import load_config

    run_dir = tmp_path / "run"
    out = asyncrl_run(
        "configs/arith-smollm2.yaml",
        run_dir,
        "--staleness.max_staleness=0",
        f"--learner.total_steps={STEPS}",
        "--learner.max_train_s=0",
        "--learner.rollout_samples_per_step=128",
        "--learner.keep_versions=10",
        "--learner.shared_weights=false",  # every version in a folder, to read back
        "--eval.every_steps=0",
        timeout_s=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    config = load_config(run_dir / "config.yaml")
    assert config.model.resolved_dtype() == "bfloat16"
    logged = {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).cuda()
    start = {k: p.detach().to(torch.bfloat16).float() for k, p in model.named_parameters()}
    measured = []
    for step, samples, norm, plain in replay(run_dir, config, model, autocast=torch.bfloat16):
        published = load_file(run_dir / "weights" / f"v{step:06d}" / "model.safetensors", device="cuda")
        ours = torch.cat([(published[k].float() - start[k]).flatten() for k in plain])
        theirs = torch.cat([(t.to(torch.bfloat16).float() - start[k]).flatten() for k, t in plain.items()])
        cosine = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))
        size = float(ours.norm() / theirs.norm())
        measured.append((step, samples, logged[step]["grad_norm"] / norm, cosine, size))
    print("step, samples, grad-norm ratio, update cosine, update size ratio:", measured)
    for _step, samples, grad_ratio, cosine, size in measured:
        assert samples == config.learner.groups_per_step * config.generator.samples_per_prompt
        assert grad_ratio == pytest.approx(1, abs=0.05), measured
        assert cosine > 0.85, measured  # measured on an H100: 0.92, 0.91, 0.89, 0.89 over four steps
        assert size == pytest.approx(1, abs=0.1), measured  # measured: 1.000 at each step
