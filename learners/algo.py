"""The ``algo`` section applied to one step: shaped rewards, advantages and the policy loss's settings.

The learner calls :func:`step_advantages` once per step on the whole batch
(every rank's share; groups are normalised whole) and builds the loss from
:func:`loss_config`. The formulas live in :mod:`learners.advantages` and
:mod:`learners.policy_loss`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

import torch

from asyncrl.config import AlgoConfig
from asyncrl.wire.protocol import Rollout
from learners.advantages import (
    GROUP_ESTIMATORS,
    TOKEN_LEVEL_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    expand_to_tokens,
    gae,
    whiten,
)
from learners.policy_loss import PolicyLossConfig


def loss_config(algo: AlgoConfig) -> PolicyLossConfig:
    """The policy loss the ``algo`` section describes (the KL term only when it goes in the loss)."""
    return PolicyLossConfig(
        eps_low=algo.clip_eps,
        eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip,
        ratio_level=algo.ratio_level,
        seq_eps_low=algo.seq_clip_eps,
        seq_eps_high=algo.seq_clip_eps_high,
        agg=algo.loss_agg,
        off_policy=algo.off_policy,
        is_cap=algo.is_cap,
        band_low=algo.mask_low,
        band_high=algo.mask_high,
        kl_coef=algo.kl_coef if algo.kl_in == "loss" else 0.0,
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
    )


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``penalty``.

    0 up to ``max_new_tokens - buffer`` tokens, then falling linearly to
    ``-penalty`` at ``max_new_tokens`` (the longest a response can be here).
    """
    if buffer <= 0:
        return 0.0
    start = max_new_tokens - buffer
    return -penalty * min(max(length - start, 0), buffer) / buffer


def shaped_rewards(batch: list[Rollout], algo: AlgoConfig, max_new_tokens: int) -> list[float]:
    """Each rollout's reward plus the overlong penalty (when ``algo.overlong_buffer`` is set); NaN where
    the reward failed, which the estimators leave out of every statistic and give advantage 0."""
    return [
        math.nan
        if r.reward_failed
        else r.reward
        + overlong_penalty(len(r.response_ids), max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        for r in batch
    ]


def step_advantages(
    batch: list[Rollout],
    algo: AlgoConfig,
    max_new_tokens: int,
    token_kl: list[torch.Tensor] | None = None,
    stale_peers: Sequence[Rollout] = (),
) -> list[torch.Tensor]:
    """One advantage tensor per rollout: ``[len(response)]`` per token, whatever the estimator's level.

    ``token_kl`` (with ``algo.kl_in: reward``): each rollout's per-token KL to
    the reference. REINFORCE++ subtracts it from each token's return; the
    group estimators subtract ``kl_coef`` times its sum from the reward.

    ``stale_peers``: members of the batch's groups dropped as stale. The group
    estimators (grpo, dr_grpo, rloo) count their rewards in their group's
    mean and std, as if the group had arrived whole: they were sampled from
    the same prompt, and leaving them out would let the drop of a group's
    long (often wrong) answers erase its signal. Their KL to the reference is
    not measured (the learner does not score them): each pays the mean KL
    penalty of its group's trained members, so that a group whose answers
    are all equally good still has nothing to learn.
    """
    lengths = [len(r.response_ids) for r in batch]
    rewards = shaped_rewards(batch, algo, max_new_tokens)
    group_ids = [r.group_id for r in batch]
    masks = [trained_mask(r) for r in batch]
    penalties: dict[str, list[float]] = defaultdict(list)  # by group
    if token_kl is not None:  # the KL of tokens the policy sampled only, not of an environment's replies
        token_kl = [kl.float() * mask for kl, mask in zip(token_kl, masks)]
    if token_kl is not None and algo.advantage not in TOKEN_LEVEL_ESTIMATORS:
        # A sequence-level estimator takes the penalty summed over the response, in its reward.
        penalty = [algo.kl_coef * float(kl.sum()) for kl in token_kl]
        rewards = [r - p for r, p in zip(rewards, penalty)]
        for group_id, p in zip(group_ids, penalty):
            penalties[group_id].append(p)
        token_kl = None
    if stale_peers and algo.advantage in GROUP_ESTIMATORS:
        peer_rewards = shaped_rewards(list(stale_peers), algo, max_new_tokens)
        if penalties:
            peer_rewards = [r - statistics.fmean(penalties[p.group_id]) for r, p in zip(peer_rewards, stale_peers)]
        rewards = rewards + peer_rewards
        group_ids = group_ids + [r.group_id for r in stale_peers]
        lengths_in = lengths + [len(r.response_ids) for r in stale_peers]
    else:
        lengths_in = lengths
    out = compute_advantages(
        algo.advantage,
        AdvantageInputs(
            rewards=rewards,
            group_ids=group_ids,
            lengths=lengths_in,
            reward_scaling=algo.reward_scaling,
            token_kl=token_kl,
            kl_coef=algo.kl_coef if token_kl is not None else 0.0,
            masks=masks if algo.advantage in TOKEN_LEVEL_ESTIMATORS else None,
        ),
    )
    return out if isinstance(out, list) else expand_to_tokens(out[: len(batch)], lengths)


def trained_mask(rollout: Rollout) -> torch.Tensor:
    """1 at each response token the loss trains on: the model's own, not an episode's environment replies."""
    if not rollout.loss_mask:  # a single-turn answer: every token is the model's
        return torch.ones(len(rollout.response_ids))
    return torch.tensor(rollout.loss_mask, dtype=torch.float32)


def gae_targets(
    batch: list[Rollout],
    algo: AlgoConfig,
    max_new_tokens: int,
    values: list[torch.Tensor],
    token_kl: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO with a critic: whitened GAE advantages and the critic's return targets, per token.

    The (shaped) reward sits on the last token; with ``algo.kl_in: reward``
    every token also pays ``kl_coef`` times its KL to the reference.
    ``values`` are the critic's, under its weights before the step.
    A rollout whose reward failed teaches neither: advantage 0, its own
    values as targets, and none of its tokens in the whitening.
    """
    rewards = []
    for i, (r, reward) in enumerate(zip(batch, shaped_rewards(batch, algo, max_new_tokens))):
        token_rewards = torch.zeros(len(r.response_ids))
        if token_rewards.numel() and not r.reward_failed:
            token_rewards[-1] = reward
        if token_kl is not None:
            token_rewards -= algo.kl_coef * token_kl[i].float()
        rewards.append(token_rewards)
    advantages, returns = gae(rewards, values, algo.gamma, algo.lam)
    trained = [(a, trained_mask(r)) for a, r in zip(advantages, batch) if not r.reward_failed]
    kept = iter(whiten([a for a, _ in trained], masks=[mask for _, mask in trained]))
    advantages = [torch.zeros_like(a) if r.reward_failed else next(kept) for a, r in zip(advantages, batch)]
    returns = [v.detach().float().clone() if r.reward_failed else g for g, v, r in zip(returns, values, batch)]
    return advantages, returns
