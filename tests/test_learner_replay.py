"""A run's learner, step after step, takes the updates a plain fp32 AdamW loop takes on the same batches.

The run logs every sample it trains on (``learner.rollout_samples_per_step``) and keeps every version it
publishes; a plain loop (transformers' model, torch's AdamW, the policy loss on the logged advantages and
behaviour log-probs) replays those batches from the same start. Whatever the learner process does between
steps (publishing, checkpoints, sampled log-probs, the engine's optimizer state) must leave its weights where
the plain loop's are.
"""

from __future__ import annotations

import json

import pytest
from conftest import asyncrl_run

pytestmark = pytest.mark.slow

STEPS = 4


def replay(run_dir, config, model, autocast=None):
    """Each logged step, replayed on ``model`` (the run's starting weights, on its device): the step, its sample
    count, the plain loop's gradient norm and its weights after the step. ``autocast``: a 16-bit dtype that the
    forward and backward passes run in, around fp32 weights (transformers' Trainer with ``bf16=True``)."""
    import contextlib

    import torch

    from learners.algo import loss_config
    from learners.packing import pack
    from learners.policy_loss import policy_loss
    from learners.rollout_sample import trained

    learner = config.learner
    optimizer = torch.optim.AdamW(model.parameters(), lr=learner.lr, betas=tuple(learner.betas), weight_decay=0.0)
    steps = trained(run_dir, config.generator.samples_per_prompt)
    for step in range(1, STEPS + 1):
        batch, advantages = steps[step]
        device = next(model.parameters()).device
        ids, attention, _, targets, behaviour, mask, advantages, _ = pack(batch, False, advantages).to(device)[:8]
        optimizer.zero_grad()
        cast = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with cast:
            logits = model(input_ids=ids, attention_mask=attention).logits.float() / config.generator.temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        tokens = sum(len(r.response_ids) for r in batch)
        policy_loss(
            logprobs, behaviour, advantages, mask, loss_config(config.algo), num_tokens=tokens, num_sequences=len(batch)
        ).loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), learner.grad_clip))
        optimizer.step()
        yield step, len(batch), norm, {k: p.detach().clone() for k, p in model.named_parameters()}


def test_the_learner_takes_a_plain_adamw_loops_steps_on_its_own_batches(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.config import load_config

    run_dir = tmp_path / "run"
    out = asyncrl_run(
        "configs/quickstart.yaml",
        run_dir,
        "--staleness.max_staleness=0",  # each step's batch comes whole from the version before it
        f"--learner.total_steps={STEPS}",
        "--learner.rollout_samples_per_step=128",  # every sample the step trains on
        "--learner.keep_versions=10",
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    config = load_config(run_dir / "config.yaml")
    logged = {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    for step, samples, norm, plain in replay(run_dir, config, model):
        assert samples == config.learner.groups_per_step * config.generator.samples_per_prompt
        assert logged[step]["grad_norm"] == pytest.approx(norm, rel=1e-4)
        published = load_file(run_dir / "weights" / f"v{step:06d}" / "model.safetensors")
        assert set(published) == set(plain)
        # AdamW's first step moves every weight by lr times the sign of its gradient, so a gradient within
        # rounding of 0 can land either way, and later steps carry those few weights' difference on; a reset
        # optimizer state or a weight changed between steps would move most weights elsewhere (measured: 0.4% of
        # the distance moved after one step, 0.2% after four)
        apart = sum(float((published[k].float() - t).square().sum()) for k, t in plain.items()) ** 0.5
        moved = sum(float((t - start[k]).square().sum()) for k, t in plain.items()) ** 0.5
        assert apart < 0.02 * moved, f"step {step}: the learner's weights are {apart:.3g} from the plain loop's"
