"""Advantage estimators against values worked out by hand from each paper's formula."""

import math

import pytest
import torch

from learners.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    dr_grpo,
    expand_to_tokens,
    group_baseline,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    whiten,
)

EPS = 1e-4
NAN = float("nan")


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_grpo_divides_by_the_unbiased_group_std():
    # Group a: mean 0.5, deviations (0.5, -0.5, 0), sample var 0.5 / 2 = 0.25, std 0.5.
    # Group b: mean 3, deviations (-1, 1), sample var 2 / 1 = 2, std sqrt(2).
    adv = grpo([1.0, 0.0, 0.5, 2.0, 4.0], ["a", "a", "a", "b", "b"])
    close(adv, [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, -1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)])


def test_grpo_gives_zero_to_all_equal_and_single_member_groups():
    adv = grpo([3.0, 3.0, 3.0, 7.0], ["same", "same", "same", "alone"])
    close(adv, [0.0, 0.0, 0.0, 0.0])


def test_nan_reward_gets_zero_and_is_left_out_of_its_group():
    # The NaN is dropped, so group a is (1, 0, 0.5) as in the first test: mean 0.5, std 0.5.
    adv = grpo([NAN, 1.0, 0.0, 0.5], ["a", "a", "a", "a"])
    close(adv, [0.0, 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0])


def test_group_left_with_one_valid_member_gets_zero():
    close(grpo([NAN, 1.0], ["a", "a"]), [0.0, 0.0])


def test_dr_grpo_subtracts_the_group_mean_only():
    # Means 0.5 and 3; no std division.
    close(dr_grpo([1.0, 0.0, 0.5, 2.0, 4.0], ["a", "a", "a", "b", "b"]), [0.5, -0.5, 0.0, -1.0, 1.0])


def test_rloo_subtracts_the_mean_of_the_other_members():
    # 1 - mean(0, 0.5) = 0.75; 0 - mean(1, 0.5) = -0.75; 0.5 - mean(1, 0) = 0
    # (= k/(k-1) * (r - mean) = 1.5 * (0.5, -0.5, 0)). Group b: 2 - 4 = -2, 4 - 2 = 2.
    close(rloo([1.0, 0.0, 0.5, 2.0, 4.0], ["a", "a", "a", "b", "b"]), [0.75, -0.75, 0.0, -2.0, 2.0])


def test_rloo_counts_only_valid_members():
    # k = 2 valid members: 1 - 0 = 1, 0 - 1 = -1.
    close(rloo([1.0, NAN, 0.0], ["a", "a", "a"]), [1.0, 0.0, -1.0])


def test_batch_scaling_divides_group_differences_by_the_batch_std():
    # Valid rewards 1, 0, 3, 5 (NaN left out): mean 2.25, squared deviations
    # 1.5625 + 5.0625 + 0.5625 + 7.5625 = 14.75, sample std sqrt(14.75 / 3).
    # Group differences: a (0.5, -0.5), b (-1, 1).
    std = math.sqrt(14.75 / 3)
    adv = group_baseline([1.0, 0.0, 3.0, 5.0, NAN], ["a", "a", "b", "b", "b"], scaling="batch")
    close(adv, [0.5 / (std + EPS), -0.5 / (std + EPS), -1 / (std + EPS), 1 / (std + EPS), 0.0])


def test_unknown_reward_scaling_is_refused():
    with pytest.raises(ValueError):
        group_baseline([1.0, 0.0], ["a", "a"], scaling="rank")


def test_reinforce_pp_whitens_returns_over_all_tokens_of_the_batch():
    # Tokens (1, 1) and (0, 0, 0); the NaN rollout is left out. Mean 2/5 = 0.4,
    # population var (2 * 0.6^2 + 3 * 0.4^2) / 5 = (0.72 + 0.48) / 5 = 0.24.
    out = reinforce_pp([1.0, 0.0, NAN], [2, 3, 2])
    std = math.sqrt(0.24)
    close(out[0], [0.6 / std, 0.6 / std])
    close(out[1], [-0.4 / std] * 3)
    close(out[2], [0.0, 0.0])


def test_reinforce_pp_charges_the_kl_still_to_come_from_each_token():
    # kl_coef 0.5. Rollout 0: reward 1, kl (0.1, 0.2, 0.3): suffix sums (0.6, 0.5, 0.3),
    # returns 1 - 0.5 * (0.6, 0.5, 0.3) = (0.7, 0.75, 0.85). Rollout 1: reward 0, kl 0.4: return -0.2.
    kl = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.4])]
    out = reinforce_pp([1.0, 0.0], [3, 1], token_kl=kl, kl_coef=0.5)
    returns = [0.7, 0.75, 0.85, -0.2]
    mean = sum(returns) / 4  # 0.525
    std = math.sqrt(sum((g - mean) ** 2 for g in returns) / 4)
    close(out[0], [(g - mean) / (std + 1e-8) for g in returns[:3]])
    close(out[1], [(-0.2 - mean) / (std + 1e-8)])


def test_a_batch_whose_returns_are_all_equal_gets_no_advantage():
    """0.1 is not exact in float32: dividing its rounding error by std + 1e-8 gave -0.43 on every token."""
    for reward in (0.1, 0.3, 1.0):
        for out in (reinforce_pp([reward] * 4, [3] * 4), whiten([torch.full((5,), reward), torch.full((2,), reward)])):
            assert all(bool((t == 0).all()) for t in out), (reward, out)


def test_reinforce_pp_keeps_empty_responses_empty():
    out = reinforce_pp([1.0, 0.0], [0, 2])
    assert out[0].shape == (0,)
    close(out[1], [0.0, 0.0])  # all returns equal: no spread, no signal


def test_reinforce_pp_baseline_centres_on_the_group_then_whitens_over_the_batch():
    # Group a (1, 0) -> (0.5, -0.5); group b (1, 1) -> (0, 0). Lengths 1, 2, 1, 1 give tokens
    # 0.5 | -0.5 -0.5 | 0 | 0: mean -0.1, population var (0.36 + 0.16 + 0.16 + 0.01 + 0.01) / 5 = 0.14.
    out = reinforce_pp_baseline([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], [1, 2, 1, 1])
    std = math.sqrt(0.14)
    close(out[0], [0.6 / std])
    close(out[1], [-0.4 / std, -0.4 / std])
    close(out[2], [0.1 / std])
    close(out[3], [0.1 / std])


def test_reinforce_pp_baseline_leaves_nan_rewards_out():
    # The NaN drops out of group a's mean and of the whitening: tokens 0.5 | -0.5, mean 0, std 0.5.
    out = reinforce_pp_baseline([1.0, 0.0, NAN], ["a", "a", "a"], [1, 1, 3])
    close(out[0], [0.5 / (0.5 + 1e-8)])
    close(out[1], [-0.5 / (0.5 + 1e-8)])
    close(out[2], [0.0, 0.0, 0.0])


def test_registry_runs_each_estimator_by_name():
    rewards, groups = [1.0, 0.0, 0.5], ["a", "a", "a"]
    close(compute_advantages("grpo", AdvantageInputs(rewards, groups)), [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0])
    close(compute_advantages("dr_grpo", AdvantageInputs(rewards, groups)), [0.5, -0.5, 0.0])
    close(compute_advantages("rloo", AdvantageInputs(rewards, groups)), [0.75, -0.75, 0.0])
    # A single group: batch std = group std = 0.5, so grpo with batch scaling gives the same numbers.
    close(
        compute_advantages("grpo", AdvantageInputs(rewards, groups, reward_scaling="batch")),
        [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0],
    )
    token_level = compute_advantages("reinforce_pp", AdvantageInputs([1.0, 0.0], ["a", "a"], lengths=[1, 1]))
    close(token_level[0], [(1.0 - 0.5) / (0.5 + 1e-8)])  # tokens 1 | 0: mean 0.5, population std 0.5
    assert TOKEN_LEVEL_ESTIMATORS == {"reinforce_pp", "reinforce_pp_baseline"}


@pytest.mark.parametrize(
    "name, inputs",
    [
        ("ppo_gae", AdvantageInputs([1.0], ["a"])),
        ("reinforce_pp", AdvantageInputs([1.0], ["a"])),  # no lengths
        ("reinforce_pp", AdvantageInputs([1.0], ["a"], lengths=[1], reward_scaling="group")),
        ("grpo", AdvantageInputs([1.0], ["a"], token_kl=[torch.zeros(1)], kl_coef=0.1)),  # KL would be dropped
    ],
)
def test_registry_refuses_what_it_cannot_honour(name, inputs):
    with pytest.raises(ValueError):
        compute_advantages(name, inputs)


def test_expand_to_tokens_repeats_each_sequence_advantage():
    out = expand_to_tokens(torch.tensor([0.5, -1.0]), [2, 1])
    close(out[0], [0.5, 0.5])
    close(out[1], [-1.0])
