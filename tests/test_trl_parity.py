"""asyncrl's GRPO step against TRL's own on one batch: the advantages, the loss and its gradient.

The peer comparison (bench/peer_trl.py) maps an asyncrl config onto TRL's GRPOConfig; these checks hold that
mapping to what TRL computes, through ``GRPOTrainer._compute_loss`` itself, on a tiny fp32 model. The one
difference between the two losses is the PPO ratio's anchor: asyncrl takes the ratio against the sampler's
log-probs (the behaviour policy), TRL, with its importance-sampling correction off, against the learner's own
(a ratio of 1 in value). They agree when the two sets of log-probs do; where they differ, the band that masks
nothing (``algo.off_policy=icepop algo.mask_low=0 algo.mask_high=.inf``) takes TRL's anchor.
"""

import random
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import ROOT

from asyncrl.wire.protocol import Rollout
from bench import peer_trl
from bench.trl_loss_parity import asyncrl_gradient, trl_gradient
from learners.algo import step_advantages

GROUP, GROUPS = 4, 3
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.5]]


def parity_config(*overrides: str):
    """The CPU workload's config as the benchmark maps it onto TRL, with groups of ``GROUP``."""
    workload = peer_trl.WORKLOADS["cpu"]
    workload = replace(workload, overrides=(*workload.overrides, f"--generator.samples_per_prompt={GROUP}", *overrides))
    config = peer_trl.load_workload_config(workload, 0, 10)
    peer_trl.check_comparable(workload, config)
    return config


def fresh_model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny-llama", dtype=torch.float32)
    model.train()
    return model


def batch(config, model, behaviour_noise: float = 0.0) -> list[Rollout]:
    """Groups of prompts of 3-6 tokens and answers of 1-8 (some hitting the token limit), scored as ``REWARDS``;
    their behaviour log-probs are the model's own, plus Gaussian noise of ``behaviour_noise``."""
    from learners.engine import PolicyLogprobs
    from learners.packing import pack, response_values

    rng = random.Random(0)
    vocab, limit = model.config.vocab_size, config.generator.max_new_tokens
    rollouts = []
    for g in range(GROUPS):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        for i in range(GROUP):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, limit))]
            rollouts.append(
                Rollout(
                    rollout_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    group_size=GROUP,
                    prompt_index=g,
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=[0.0] * len(response),
                    versions=[0] * len(response),
                    reward=REWARDS[g][i],
                    finish_reason="length" if len(response) == limit else "stop",
                    generator_id="gen-0",
                    created_s=0.0,
                )
            )
    policy = PolicyLogprobs(model, config.learner.logprob_chunk_tokens)
    inputs = pack(rollouts, False)
    with torch.no_grad():
        own, _ = policy(inputs.ids, inputs.attention_mask, inputs.targets, config.generator.temperature)
    noise = torch.Generator().manual_seed(1)
    out = []
    for rollout, logprobs in zip(rollouts, response_values(own, rollouts, False)):
        logprobs = logprobs + behaviour_noise * torch.randn(logprobs.shape, generator=noise)
        out.append(msgspec.structs.replace(rollout, logprobs=logprobs.tolist()))
    return out


def both_sides(config, out: Path, behaviour_noise: float = 0.0):
    """(asyncrl's loss, TRL's loss, gradient cosine, gradient norm ratio, advantage gap) from one model state;
    TRL's trainer writes its output folder under ``out``."""
    model = fresh_model()
    rollouts = batch(config, model, behaviour_noise)
    advantages = step_advantages(rollouts, config.algo, config.generator.max_new_tokens)
    ours, ours_grad = asyncrl_gradient(model, config, rollouts, advantages)
    theirs, theirs_grad, advantage_gap = trl_gradient(model, config, rollouts, advantages, 0, str(out))
    cosine = float(torch.nn.functional.cosine_similarity(ours_grad.double(), theirs_grad.double(), 0))
    return ours, theirs, cosine, float(ours_grad.norm() / theirs_grad.norm()), advantage_gap


def test_asyncrls_grpo_advantages_loss_and_gradient_are_trls_on_policy(tmp_path):
    ours, theirs, cosine, norm_ratio, advantage_gap = both_sides(parity_config(), tmp_path)
    assert advantage_gap < 1e-6  # TRL recomputes the group advantages from the rewards
    assert ours != 0.0
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert cosine > 1 - 1e-9
    assert norm_ratio == pytest.approx(1.0, abs=1e-5)


def test_a_sampler_that_differs_from_the_learner_moves_asyncrls_anchor_and_the_open_band_takes_trls(tmp_path):
    """Behaviour log-probs off by noise of 0.3: asyncrl's ratio against them clips and reweights tokens, which
    TRL's (against the learner's own log-probs) does not; the band that masks nothing gives TRL's gradient back."""
    _, _, cosine, _, _ = both_sides(parity_config(), tmp_path, behaviour_noise=0.3)
    assert cosine < 0.99  # the anchor is a real difference (0.82 here)
    open_band = parity_config("--algo.off_policy=icepop", "--algo.mask_low=0", "--algo.mask_high=.inf")
    ours, theirs, cosine, norm_ratio, _ = both_sides(open_band, tmp_path, behaviour_noise=0.3)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert cosine > 1 - 1e-9
    assert norm_ratio == pytest.approx(1.0, abs=1e-5)
