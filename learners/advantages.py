"""Sequence- and token-level advantage estimators, registered by name (config key ``algo.advantage``).

Every estimator is a pure function of the step's rewards (one per rollout,
NaN where the reward failed), their group ids and, for REINFORCE++, the
response lengths and optional per-token KL. A NaN reward gets advantage 0
and is left out of every statistic, so one failed reward neither poisons
its group's mean nor shifts the batch's.

Sequence-level estimators return a float32 tensor ``[N]``; token-level ones
(``TOKEN_LEVEL_ESTIMATORS``) return a list of N float32 tensors, the i-th of
length ``lengths[i]``. ``expand_to_tokens`` turns the former into the latter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

RewardScaling = Literal["group", "batch", "none"]
Rewards = Sequence[float] | torch.Tensor


def _as_rewards(rewards: Rewards) -> torch.Tensor:
    return torch.as_tensor(rewards, dtype=torch.float32).detach().reshape(-1).clone()


def _group_members(group_ids: Sequence[str]) -> list[list[int]]:
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def _sample_std(x: torch.Tensor) -> float:
    """Unbiased standard deviation; 0 for fewer than two values (no spread to divide by)."""
    return float(x.std()) if x.numel() > 1 else 0.0


def group_baseline(
    rewards: Rewards,
    group_ids: Sequence[str],
    *,
    scaling: RewardScaling = "group",
    leave_one_out: bool = False,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Each reward minus its group's mean, optionally scaled: the common core of GRPO, Dr. GRPO and RLOO.

    ``A_i = (r_i - mean_g) * (k / (k - 1) if leave_one_out) / (std + eps if scaled)``,
    over the k valid (non-NaN) members of i's group. ``leave_one_out`` turns
    the baseline into the mean of the *other* members (RLOO), since
    ``r_i - mean(others) = k / (k - 1) * (r_i - mean_g)``.

    ``scaling``: ``group`` divides by the group's unbiased std (GRPO, as TRL
    computes it); ``batch`` by the unbiased std of all valid rewards in the
    batch (group mean, batch std: the "Lite PPO" normalisation of Liu et al.
    2025, "Part I: Tricks or Traps?"); ``none`` leaves the difference alone.
    A group with fewer than two valid members gets zeros: it has no baseline
    but the reward itself. All-equal groups get zeros because the difference is 0.
    """
    if scaling not in ("group", "batch", "none"):
        raise ValueError(f"reward scaling must be 'group', 'batch' or 'none', not {scaling!r}")
    r = _as_rewards(rewards)
    if len(group_ids) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    valid = ~torch.isnan(r)
    out = torch.zeros_like(r)
    batch_std = _sample_std(r[valid])
    for members in _group_members(group_ids):
        idx = torch.tensor([i for i in members if valid[i]], dtype=torch.long)
        k = idx.numel()
        if k < 2:
            continue
        values = r[idx].double()  # in float32 the mean of equal rewards can miss them by a rounding unit
        adv = values - values.mean()
        if leave_one_out:
            adv = adv * (k / (k - 1))
        if scaling == "group":
            adv = adv / (values.std() + eps)
        elif scaling == "batch":
            adv = adv / (batch_std + eps)
        out[idx] = adv.to(out.dtype)
    return out


def grpo(
    rewards: Rewards, group_ids: Sequence[str], *, scaling: RewardScaling = "group", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(r_i - mean_g) / (std_g + eps)``, std unbiased."""
    return group_baseline(rewards, group_ids, scaling=scaling, eps=eps)


def dr_grpo(rewards: Rewards, group_ids: Sequence[str]) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r_i - mean_g``, no std division.

    Dividing by the group's std up-weights groups that are nearly all right or
    all wrong; Dr. GRPO drops it (and pairs with a constant-horizon loss
    normaliser, ``seq-mean-token-sum-norm`` in ``policy_loss``).
    """
    return group_baseline(rewards, group_ids, scaling="none")


def rloo(
    rewards: Rewards, group_ids: Sequence[str], *, scaling: RewardScaling = "none", eps: float = 1e-4
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): ``r_i - mean(r_j, j != i)`` within the group.

    Equal to ``k / (k - 1) * (r_i - mean_g)`` for a group of k valid members.
    """
    return group_baseline(rewards, group_ids, scaling=scaling, leave_one_out=True, eps=eps)


def reinforce_pp(
    rewards: Rewards,
    lengths: Sequence[int],
    *,
    token_kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    masks: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """REINFORCE++ (Hu 2025): per-token returns with the KL penalty in the reward, whitened over the batch.

    The reward sits on the last token and each token pays ``kl_coef * kl_t``,
    so with no discount the return at t is
    ``G_t = r - kl_coef * sum_{s >= t} kl_s``. The advantages are
    the returns whitened (:func:`whiten`) over every token of every valid
    rollout in the batch.
    ``token_kl[i]`` holds rollout i's per-token KL (see
    ``policy_loss.kl_penalty``). A NaN reward's tokens get 0 and do not enter
    the mean or std. Returns one ``[lengths[i]]`` tensor per rollout.
    """
    r = _as_rewards(rewards)
    if len(lengths) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(lengths)} lengths")
    if token_kl is not None and len(token_kl) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(token_kl)} per-token KL tensors")
    returns: list[torch.Tensor] = []
    for i, n in enumerate(lengths):
        g = torch.full((n,), float(r[i]), dtype=torch.float32)
        if token_kl is not None and kl_coef != 0.0:
            kl = torch.as_tensor(token_kl[i], dtype=torch.float32).detach().reshape(-1)
            if kl.numel() != n:
                raise ValueError(f"rollout {i}: {n} tokens but {kl.numel()} KL values")
            # Reverse cumulative sum: the KL still to be paid from t to the end.
            g = g - kl_coef * kl.flip(0).cumsum(0).flip(0)
        returns.append(g)
    failed = [math.isnan(float(reward)) for reward in r]
    kept_masks = None if masks is None else [m for m, no in zip(masks, failed) if not no]
    whitened = iter(whiten([g for g, no in zip(returns, failed) if not no], eps, kept_masks))
    return [torch.zeros_like(g) if no else next(whitened) for g, no in zip(returns, failed)]


def reinforce_pp_baseline(
    rewards: Rewards,
    group_ids: Sequence[str],
    lengths: Sequence[int],
    *,
    token_kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    masks: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025; OpenRLHF's ``reinforce_baseline``): group mean first, batch whitening after.

    Each reward minus its group's mean (no std), then ``reinforce_pp`` on the
    centred rewards: KL in the reward and token-level whitening over the
    batch. The group mean removes the prompt's difficulty; the batch std is
    more stable than a group's std for small groups.
    """
    r = _as_rewards(rewards)
    centred = group_baseline(r, group_ids, scaling="none")
    centred[torch.isnan(r)] = float("nan")
    return reinforce_pp(centred, lengths, token_kl=token_kl, kl_coef=kl_coef, eps=eps, masks=masks)


def expand_to_tokens(advantages: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """One ``[lengths[i]]`` tensor per rollout, filled with its sequence-level advantage."""
    return [torch.full((n,), float(a), dtype=torch.float32) for a, n in zip(advantages, lengths)]


def gae(
    token_rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor], gamma: float = 1.0, lam: float = 0.95
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalized advantage estimation (Schulman et al. 2016) for each response, and the critic's targets.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` after the last token
    0, ``A_t = sum_k (gamma * lam)^k * delta_{t+k}`` and returns
    ``R_t = A_t + V_t``. Returns ``(advantages, returns)``, one tensor per
    response; PPO-RLHF (Ouyang et al. 2022, as OpenRLHF and verl run it)
    puts the reward on the last token and whitens the advantages afterwards.
    """
    advantages, returns = [], []
    for r, v in zip(token_rewards, values):
        r, v = r.float(), v.float()
        out = torch.zeros_like(r)
        running = 0.0
        for t in range(r.numel() - 1, -1, -1):
            following = v[t + 1] if t + 1 < v.numel() else 0.0
            running = float(r[t] + gamma * following - v[t]) + gamma * lam * running
            out[t] = running
        advantages.append(out)
        returns.append(out + v)
    return advantages, returns


def whiten(
    per_token: Sequence[torch.Tensor], eps: float = 1e-8, masks: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Zero mean and unit (population) std over every token of the batch: ``(x - mean) / sqrt(max(var, eps))``.

    ``masks`` (one per tensor, 1 where a token is trained): the mean and std are taken over those tokens only,
    as OpenRLHF and verl take them over the action mask; an episode's environment replies, and the tokens of
    an episode masked whole, then weigh nothing in them.

    As OpenRLHF and verl whiten: the variance, not the std, is floored, so a
    batch whose values are all equal gets advantages 0 (reduced in float64,
    where ``x - mean`` is exactly 0), not float32 rounding blown up to O(1).
    """
    if not per_token:
        return []
    flat = torch.cat([t.double().reshape(-1) for t in per_token])
    if masks is not None:
        flat = flat[torch.cat([torch.as_tensor(m).reshape(-1) for m in masks]) > 0]
    if not flat.numel():
        return [t.float() for t in per_token]
    mean, inv_std = flat.mean(), flat.var(unbiased=False).clamp(min=eps).rsqrt()
    return [((t.double() - mean) * inv_std).float() for t in per_token]


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. ``reward_scaling`` None keeps the estimator's own."""

    rewards: Rewards
    group_ids: Sequence[str]
    lengths: Sequence[int] | None = None
    token_kl: Sequence[torch.Tensor] | None = None
    kl_coef: float = 0.0
    reward_scaling: RewardScaling | None = None
    masks: Sequence[torch.Tensor] | None = None  # per rollout, 1 at the tokens trained on (None: every token)


def _needs_lengths(x: AdvantageInputs) -> Sequence[int]:
    if x.lengths is None:
        raise ValueError("token-level estimators need the response lengths")
    return x.lengths


def _group_only(x: AdvantageInputs) -> None:
    # A KL penalty asked for "in the reward" would be silently dropped by a sequence-level estimator.
    if x.token_kl is not None and x.kl_coef != 0.0:
        raise ValueError("a KL penalty in the reward needs a token-level estimator (reinforce_pp*)")


def _token_only(x: AdvantageInputs) -> None:
    if x.reward_scaling is not None:
        raise ValueError("reward_scaling applies to the group estimators only")


def _grpo(x: AdvantageInputs) -> torch.Tensor:
    _group_only(x)
    return grpo(x.rewards, x.group_ids, scaling=x.reward_scaling or "group")


def _dr_grpo(x: AdvantageInputs) -> torch.Tensor:
    _group_only(x)
    return group_baseline(x.rewards, x.group_ids, scaling=x.reward_scaling or "none")


def _rloo(x: AdvantageInputs) -> torch.Tensor:
    _group_only(x)
    return rloo(x.rewards, x.group_ids, scaling=x.reward_scaling or "none")


def _reinforce_pp(x: AdvantageInputs) -> list[torch.Tensor]:
    _token_only(x)
    return reinforce_pp(x.rewards, _needs_lengths(x), token_kl=x.token_kl, kl_coef=x.kl_coef, masks=x.masks)


def _reinforce_pp_baseline(x: AdvantageInputs) -> list[torch.Tensor]:
    _token_only(x)
    lengths = _needs_lengths(x)
    return reinforce_pp_baseline(x.rewards, x.group_ids, lengths, token_kl=x.token_kl, kl_coef=x.kl_coef, masks=x.masks)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], torch.Tensor | list[torch.Tensor]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
}
TOKEN_LEVEL_ESTIMATORS = frozenset({"reinforce_pp", "reinforce_pp_baseline"})
GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo"})  # each sample against its group's statistics only


def compute_advantages(name: str, inputs: AdvantageInputs) -> torch.Tensor | list[torch.Tensor]:
    """Run the estimator registered as ``name``: ``[N]`` for sequence-level ones, per-token lists otherwise.

    GAE is not here: it needs the critic's values (``learners.algo.gae_targets``).
    """
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return estimator(inputs)
