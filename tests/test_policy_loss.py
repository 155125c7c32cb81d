"""Policy loss against values and gradients worked out by hand from each paper's formula.

Log-probs are built from chosen ratios: with ``logp = 0``, ``behaviour = -log(ratio)``
makes ``exp(logp - behaviour)`` exactly the ratio written in the test.
"""

import math

import pytest
import torch

from learners.aggregation import aggregate
from learners.policy_loss import LossCounts, PolicyLossConfig, kl_penalty, policy_loss


def neg_log(ratios: list[list[float]]) -> torch.Tensor:
    return -torch.log(torch.tensor(ratios, dtype=torch.float32))


def zeros_with_grad(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols, requires_grad=True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def close(actual: torch.Tensor | float, expected, tol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32), rtol=tol, atol=tol
    )


# Two rows of three tokens; row 1's last token is padding. Ratios (logp - behaviour):
RATIOS = [[1.0, 1.5, 0.5], [1.1, 0.7, 1.3]]
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_ppo_clip_token_mean_value_and_gradient():
    lp = zeros_with_grad(2, 3)
    stats = policy_loss(lp, neg_log(RATIOS), ADV, MASK, PolicyLossConfig(eps_low=0.2), num_tokens=5, num_sequences=2)
    # Per token max(-A r, -A clip(r, 0.8, 1.2)):
    # row 0 (A = 1):  r 1 -> -1;  r 1.5 -> max(-1.5, -1.2) = -1.2;  r 0.5 -> max(-0.5, -0.8) = -0.5
    # row 1 (A = -1): r 1.1 -> max(1.1, 1.1) = 1.1;  r 0.7 -> max(0.7, 0.8) = 0.8;  (r 1.3 masked)
    close(stats.loss, (-1 - 1.2 - 0.5 + 1.1 + 0.8) / 5)
    # d/dlogp = -A r / N where unclipped, 0 where the clip is active (r 1.5 with A > 0, r 0.7 with A < 0).
    close(grad_of(stats.loss, lp), [[-1 * 1.0 / 5, 0.0, -1 * 0.5 / 5], [1.1 / 5, 0.0, 0.0]])
    c = stats.counts
    assert (c.tokens, c.sequences) == (5, 2)
    close(c.approx_kl_sum, sum(r - 1 - math.log(r) for r in [1.0, 1.5, 0.5, 1.1, 0.7]))


def test_clip_fraction_counts_only_tokens_clipped_for_their_advantage_sign():
    stats = policy_loss(
        zeros_with_grad(2, 3), neg_log(RATIOS), ADV, MASK, PolicyLossConfig(eps_low=0.2), num_tokens=5, num_sequences=2
    )
    # |r - 1| > 0.2 holds for r = 1.5, 0.5, 0.7 (3 tokens), but r = 0.5 has A > 0: the unclipped
    # term is the minimum there and the token keeps its gradient. Only 1.5 (A > 0) and 0.7 (A < 0) count.
    assert stats.counts.clipped_tokens == 2
    close(stats.counts.clip_fraction, 2 / 5)


def test_clip_higher_widens_only_the_upper_bound():
    lp = zeros_with_grad(2, 3)
    stats = policy_loss(
        lp, neg_log(RATIOS), ADV, MASK, PolicyLossConfig(eps_low=0.2, eps_high=0.28), num_tokens=5, num_sequences=2
    )
    # As the first test, but r 1.5 clips at 1.28; r 0.7 still clips at 0.8 for A < 0.
    close(stats.loss, (-1 - 1.28 - 0.5 + 1.1 + 0.8) / 5)
    assert stats.counts.clipped_tokens == 2


def test_dual_clip_bounds_negative_advantage_losses():
    lp = zeros_with_grad(2, 2)
    ratios = [[4.0, 2.0], [4.0, 1.0]]
    cfg = PolicyLossConfig(eps_low=0.2, dual_clip=3.0)
    stats = policy_loss(
        lp, neg_log(ratios), torch.tensor([-1.0, 1.0]), torch.ones(2, 2), cfg, num_tokens=4, num_sequences=2
    )
    # Row 0 (A = -1): r 4 -> min(max(4, 1.2), 3) = 3 (dual clip); r 2 -> max(2, 1.2) = 2 < 3.
    # Row 1 (A = 1):  r 4 -> max(-4, -1.2) = -1.2 (dual clip never applies to A > 0); r 1 -> -1.
    close(stats.loss, (3 + 2 - 1.2 - 1) / 4)
    close(grad_of(stats.loss, lp), [[0.0, 1 * 2.0 / 4], [0.0, -1 * 1.0 / 4]])
    assert stats.counts.dual_clipped_tokens == 1 and stats.counts.clipped_tokens == 1
    close(stats.counts.dual_clip_fraction, 1 / 4)


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 empty
    kw = {"num_tokens": 4, "num_sequences": 2, "horizon": 3}
    close(aggregate(values, mask, "token-mean", **kw), (1 + 2 + 3 + 4) / 4)
    close(aggregate(values, mask, "seq-mean-token-sum", **kw), (6 + 4) / 2)
    close(aggregate(values, mask, "seq-mean-token-mean", **kw), (6 / 3 + 4 / 1) / 2)
    close(aggregate(values, mask, "seq-mean-token-sum-norm", **kw), (6 / 3 + 4 / 3) / 2)


def test_a_step_with_fewer_sequences_than_ranks_keeps_its_scale():
    """One sequence on 4 ranks: the rank holding it divides by 1/4, the three empty ones add 0, and DeepSpeed's
    average over the 4 gives the sequence's own loss (a normaliser floored at 1 gave a quarter of it)."""
    values, mask = torch.tensor([[2.0, 4.0]]), torch.ones(1, 2)
    for mode, expected in (("seq-mean-token-mean", 3.0), ("token-mean", 3.0), ("seq-mean-token-sum", 6.0)):
        holder = aggregate(values, mask, mode, num_tokens=2 / 4, num_sequences=1 / 4)
        empty = aggregate(values[:, :0], mask[:, :0], mode, num_tokens=2 / 4, num_sequences=1 / 4)
        close((holder + 3 * empty) / 4, expected)


def test_packed_rows_aggregate_per_segment():
    # One packed row holding sequence 0 (1, 2) and sequence 1 (3): means 1.5 and 3.
    values, mask = torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3)
    out = aggregate(
        values, mask, "seq-mean-token-mean", num_tokens=3, num_sequences=2, segment_ids=torch.tensor([[0, 0, 1]])
    )
    close(out, (1.5 + 3.0) / 2)


def test_packed_row_takes_one_advantage_per_segment():
    # One row packing sequence 0 (ratios 1.0, 1.5; A = 1) and sequence 1 (ratio 0.7; A = -1).
    # Token losses -1, -1.2 (clipped) | 0.8 (clipped); seq-mean-token-mean: ((-1 - 1.2) / 2 + 0.8) / 2.
    stats = policy_loss(
        zeros_with_grad(1, 3),
        neg_log([[1.0, 1.5, 0.7]]),
        torch.tensor([1.0, -1.0]),
        torch.ones(1, 3),
        PolicyLossConfig(eps_low=0.2, agg="seq-mean-token-mean"),
        num_tokens=3,
        num_sequences=2,
        segment_ids=torch.tensor([[0, 0, 1]]),
    )
    close(stats.loss, (-2.2 / 2 + 0.8) / 2)
    assert stats.counts.sequences == 2 and stats.counts.clipped_tokens == 2


def test_seq_sum_norm_needs_a_horizon():
    with pytest.raises(ValueError):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", num_tokens=2, num_sequences=1)


def make_step(rows: int = 4, cols: int = 4):
    """A fixed batch with every term active: uneven masks, an empty row, clipped and dual-clipped tokens."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(rows, cols, generator=g) * 2).requires_grad_()
    behaviour = logp.detach() + torch.randn(rows, cols, generator=g) * 0.6
    proximal = logp.detach() + torch.randn(rows, cols, generator=g) * 0.3
    reference = logp.detach() + torch.randn(rows, cols, generator=g) * 0.2
    entropy = torch.rand(rows, cols, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -1.5, 0.5, -0.5])
    return logp, behaviour, proximal, reference, entropy, mask, adv


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize(
    "off_policy, ratio_level",
    [("tis", "token"), ("decoupled", "token"), ("icepop", "token"), ("seq_mask", "token"), ("none", "sequence")],
)
def test_micro_batch_losses_and_counts_sum_to_the_whole_step(agg, off_policy, ratio_level):
    logp, behaviour, proximal, reference, entropy, mask, adv = make_step()
    cfg = PolicyLossConfig(
        eps_low=0.1,
        eps_high=0.15,
        dual_clip=1.5,
        agg=agg,
        off_policy=off_policy,
        ratio_level=ratio_level,
        seq_eps_low=0.1,
        seq_eps_high=0.1,
        band_low=0.6,
        band_high=1.6,
        is_cap=1.3,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
    )
    norm = {"num_tokens": float(mask.sum()), "num_sequences": 3.0, "horizon": 4.0}

    def run(rows: slice):
        return policy_loss(
            logp[rows],
            behaviour[rows],
            adv[rows],
            mask[rows],
            cfg,
            proximal_logprobs=proximal[rows],
            reference_logprobs=reference[rows],
            entropy=entropy[rows],
            **norm,
        )

    whole, first, second = run(slice(None)), run(slice(0, 2)), run(slice(2, None))
    close(first.loss + second.loss, whole.loss)
    close(grad_of(first.loss + second.loss, logp), grad_of(whole.loss, logp))
    merged = first.counts + second.counts
    for name, value in vars(whole.counts).items():
        assert math.isclose(getattr(merged, name), value, rel_tol=1e-6, abs_tol=1e-6), name
    # The batch is built so that every mechanism acts on some tokens but not on all.
    assert whole.counts.sequences == 3 and 0 < whole.counts.clipped_tokens < whole.counts.tokens
    assert (0 < whole.counts.masked_tokens < whole.counts.tokens) == (off_policy != "none")


def test_empty_mask_rows_contribute_nothing():
    lp = zeros_with_grad(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        stats = policy_loss(
            lp,
            neg_log([[1.0, 1.0], [5.0, 5.0]]),
            torch.tensor([1.0, 3.0]),
            mask,
            PolicyLossConfig(agg=agg),
            num_tokens=2,
            num_sequences=1,
        )
        close(stats.loss, {"token-mean": -2 / 2, "seq-mean-token-sum": -2 / 1, "seq-mean-token-mean": -1 / 1}[agg])
        assert stats.counts.sequences == 1 and stats.counts.tokens == 2
    # A fully masked micro-batch (a rank with nothing to do) gives a finite zero loss and zero counts.
    empty = policy_loss(
        lp,
        torch.zeros(2, 2),
        torch.zeros(2),
        torch.zeros(2, 2),
        PolicyLossConfig(agg="seq-mean-token-mean"),
        num_tokens=0,
        num_sequences=0,
    )
    assert empty.loss.item() == 0.0 and empty.counts == LossCounts()
    assert torch.equal(grad_of(empty.loss, lp), torch.zeros(2, 2))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -0.5])  # d = logp - ref = 1, -0.5
    close(kl_penalty(logp, ref, "k1"), [1.0, -0.5])
    close(kl_penalty(logp, ref, "k2"), [0.5 * 1.0, 0.5 * 0.25])
    close(kl_penalty(logp, ref, "k3"), [math.exp(-1) + 1 - 1, math.exp(0.5) - 0.5 - 1])


def test_kl_term_in_the_loss_and_its_gradient():
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -0.5]])  # d = 1, -0.5
    cfg = PolicyLossConfig(kl_coef=0.5, kl_estimator="k2")
    stats = policy_loss(
        lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), cfg, num_tokens=2, num_sequences=1, reference_logprobs=ref
    )
    # No advantage: loss = 0.5 * mean(d^2 / 2); d/dlogp = 0.5 * d / 2.
    close(stats.loss, 0.5 * (0.5 + 0.125) / 2)
    close(grad_of(stats.loss, lp), [[0.5 * 1.0 / 2, 0.5 * -0.5 / 2]])
    close(stats.counts.kl_ref, (0.5 + 0.125) / 2)


def test_entropy_bonus_is_subtracted_and_aggregated_like_the_loss():
    entropy = torch.tensor([[0.5, 1.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    stats = policy_loss(
        zeros_with_grad(1, 3),
        torch.zeros(1, 3),
        torch.zeros(1),
        mask,
        PolicyLossConfig(entropy_coef=0.1),
        num_tokens=2,
        num_sequences=1,
        entropy=entropy,
    )
    close(stats.loss, -0.1 * (0.5 + 1.0) / 2)
    close(grad_of(stats.loss, entropy), [[-0.1 / 2, -0.1 / 2, 0.0]])
    close(stats.counts.entropy, 0.75)


# One row, three tokens, A = 1. Ratio of the policy to the proximal policy (1.1, 1.5, 1.0);
# ratio of proximal to behaviour r = (0.5, 1.0, 3.0).
PROX_RATIOS, R = [[1.1, 1.5, 1.0]], [[0.5, 1.0, 3.0]]


def off_policy_case(off_policy: str, **kw):
    lp = zeros_with_grad(1, 3)
    proximal = neg_log(PROX_RATIOS)
    behaviour = proximal - torch.log(torch.tensor(R))
    cfg = PolicyLossConfig(eps_low=0.2, off_policy=off_policy, is_cap=2.0, **kw)
    stats = policy_loss(
        lp,
        behaviour,
        torch.tensor([1.0]),
        torch.ones(1, 3),
        cfg,
        num_tokens=3,
        num_sequences=1,
        proximal_logprobs=proximal,
    )
    return lp, stats


def test_none_with_proximal_clips_against_it_and_ignores_behaviour():
    _, stats = off_policy_case("none")
    close(stats.loss, (-1.1 - 1.2 - 1.0) / 3)  # 1.5 clips at 1.2


def test_none_without_proximal_is_ppo_on_the_behaviour_logprobs():
    lp = zeros_with_grad(1, 3)
    # Ratios to behaviour: 1.1 * 0.5 = 0.55, 1.5 * 1 = 1.5, 1 * 3 = 3: -0.55 (A > 0, unclipped), -1.2, -1.2.
    behaviour = neg_log([[0.55, 1.5, 3.0]])
    stats = policy_loss(
        lp,
        behaviour,
        torch.tensor([1.0]),
        torch.ones(1, 3),
        PolicyLossConfig(eps_low=0.2),
        num_tokens=3,
        num_sequences=1,
    )
    close(stats.loss, (-0.55 - 1.2 - 1.2) / 3)


def test_tis_weights_tokens_by_the_truncated_proximal_behaviour_ratio():
    lp, stats = off_policy_case("tis")
    # Weights min(r, 2) = (0.5, 1, 2) times (-1.1, -1.2, -1.0).
    close(stats.loss, (0.5 * -1.1 + 1 * -1.2 + 2 * -1.0) / 3)
    # Weights are constants: d/dlogp = -A * w * ratio / N where unclipped.
    close(grad_of(stats.loss, lp), [[-0.5 * 1.1 / 3, 0.0, -2 * 1.0 / 3]])
    c = stats.counts
    assert c.masked_tokens == 1 and c.clipped_tokens == 1
    close(c.is_ratio_mean, (0.5 + 1.0 + 3.0) / 3)
    close(c.is_ratio_max, 3.0)
    close(c.mismatch_kl, sum(r - 1 - math.log(r) for r in [0.5, 1.0, 3.0]) / 3)
    close(c.approx_kl, sum(r - 1 - math.log(r) for r in [1.1, 1.5, 1.0]) / 3)


def test_decoupled_ppo_drops_tokens_over_the_cap():
    _, stats = off_policy_case("decoupled")
    # Weights r where r <= 2, else 0: (0.5, 1, 0).
    close(stats.loss, (0.5 * -1.1 + 1 * -1.2 + 0 * -1.0) / 3)
    assert stats.counts.masked_tokens == 1


def test_icepop_zeroes_tokens_outside_the_band():
    _, stats = off_policy_case("icepop", band_low=0.6, band_high=2.5)
    # r = 0.5 and 3.0 fall outside [0.6, 2.5]; only the middle token (-1.2) remains; N stays 3.
    close(stats.loss, -1.2 / 3)
    assert stats.counts.masked_tokens == 2


def test_seq_mask_drops_sequences_by_their_geometric_mean_ratio():
    lp = zeros_with_grad(2, 2)
    # Row 0: r = (0.5, 2.0), geometric mean sqrt(0.5 * 2) = 1: kept although both tokens are far off.
    # Row 1: r = (1.5, 1.5), geometric mean 1.5: dropped for the band [0.9, 1.1].
    behaviour = neg_log([[0.5, 2.0], [1.5, 1.5]])  # proximal = current logp = 0
    cfg = PolicyLossConfig(off_policy="seq_mask", band_low=0.9, band_high=1.1)
    stats = policy_loss(
        lp,
        behaviour,
        torch.tensor([1.0, 1.0]),
        torch.ones(2, 2),
        cfg,
        num_tokens=4,
        num_sequences=2,
        proximal_logprobs=lp.detach(),
    )
    close(stats.loss, (-1 - 1 + 0 + 0) / 4)
    assert stats.counts.masked_tokens == 2


def test_correction_without_proximal_uses_the_detached_current_logprobs():
    lp = zeros_with_grad(1, 2)
    # Proximal := sg(logp), so the ratio is 1 in value and the loss an IS-weighted policy gradient:
    # w = min(exp(0 - behaviour), 2) = (1.5, 2); loss = -(1.5 + 2) / 2; d/dlogp = -A * w / N.
    stats = policy_loss(
        lp,
        neg_log([[1.5, 3.0]]),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        PolicyLossConfig(off_policy="tis", is_cap=2.0),
        num_tokens=2,
        num_sequences=1,
    )
    close(stats.loss, -(1.5 + 2.0) / 2)
    close(grad_of(stats.loss, lp), [[-1.5 / 2, -2.0 / 2]])


def test_gspo_uses_one_clipped_sequence_ratio():
    lp = zeros_with_grad(2, 3)
    # Row 0: log ratios (0.1, -0.1, 0.3), mean 0.1, s = e^0.1 ~ 1.105, A = 2: unclipped in [0.8, 1.2].
    # Row 1: log ratios (0.5, 0.5), mean 0.5, s = e^0.5 ~ 1.65, A = 1: clipped at 1.2 for both tokens.
    behaviour = -torch.tensor([[0.1, -0.1, 0.3], [0.5, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = PolicyLossConfig(ratio_level="sequence", seq_eps_low=0.2, seq_eps_high=0.2, agg="seq-mean-token-mean")
    stats = policy_loss(lp, behaviour, torch.tensor([2.0, 1.0]), mask, cfg, num_tokens=5, num_sequences=2)
    s0 = math.exp(0.1)
    close(stats.loss, (-2 * s0 + -1 * 1.2) / 2)
    # GSPO: d(-A s / G)/dlogp_t = -A * s / (|y| G), since ds/dlogp_t = s / |y|; row 1 is clipped.
    close(grad_of(stats.loss, lp), [[-2 * s0 / (3 * 2)] * 3, [0.0, 0.0, 0.0]])
    assert stats.counts.clipped_tokens == 2


def test_loss_counts_add_and_keep_the_max_ratio():
    a = LossCounts(tokens=2, clipped_tokens=1, is_ratio_sum=3.0, is_ratio_max=2.5)
    b = LossCounts(tokens=6, clipped_tokens=1, is_ratio_sum=5.0, is_ratio_max=1.5)
    total = a + b
    assert (total.tokens, total.clipped_tokens, total.is_ratio_max) == (8, 2, 2.5)
    assert total.clip_fraction == 2 / 8 and total.is_ratio_mean == 8.0 / 8
    assert set(total.summary()) == {
        "clip_fraction",
        "dual_clip_fraction",
        "approx_kl",
        "mismatch_kl",
        "is_ratio_mean",
        "is_ratio_max",
        "masked_fraction",
        "entropy",
        "kl_ref",
    }


@pytest.mark.parametrize(
    "kw",
    [
        {"agg": "token-sum"},
        {"off_policy": "vtrace"},
        {"dual_clip": 1.1},
        {"kl_estimator": "k4"},
        {"band_low": 2.0, "band_high": 1.0},
        {"eps_low": 1.5},
    ],
)
def test_config_refuses_invalid_options(kw):
    with pytest.raises(ValueError):
        PolicyLossConfig(**kw)


def test_coefficients_without_their_inputs_are_refused():
    args = (zeros_with_grad(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError):
        policy_loss(*args, PolicyLossConfig(kl_coef=0.1), num_tokens=2, num_sequences=1)
    with pytest.raises(ValueError):
        policy_loss(*args, PolicyLossConfig(entropy_coef=0.1), num_tokens=2, num_sequences=1)


def test_a_ratio_far_past_the_clip_neither_overflows_nor_poisons_the_gradient():
    # Log-ratios of 90 (exp overflows float32) on a negative- and a positive-advantage token: with the
    # log-ratio bounded at 20 and the dual clip at 3, the first loses -c * A = 3 with no gradient, the
    # second is clipped at 1.2 with no gradient; the third token is an ordinary one.
    lp = torch.tensor([[90.0], [90.0], [0.0]], requires_grad=True)
    stats = policy_loss(
        lp,
        torch.zeros(3, 1),
        torch.tensor([-1.0, 1.0, 1.0]),
        torch.ones(3, 1),
        PolicyLossConfig(dual_clip=3.0),
        num_tokens=3,
        num_sequences=3,
    )
    close(stats.loss, (3.0 - 1.2 - 1.0) / 3)
    close(grad_of(stats.loss, lp), [[0.0], [0.0], [-1.0 / 3]])


def test_what_lies_outside_the_mask_cannot_turn_the_loss_into_nan():
    # A prompt position where policy and reference differ by 94 nats (k3 = e^94: inf in float32 unbounded).
    lp = torch.tensor([[-100.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-6.0, -1.0, -1.0]])
    stats = policy_loss(
        lp,
        lp.detach(),
        torch.ones(1),
        torch.tensor([[0.0, 1.0, 1.0]]),
        PolicyLossConfig(kl_coef=0.01),
        num_tokens=2,
        num_sequences=1,
        reference_logprobs=ref,
    )
    close(stats.loss, -1.0)
    close(grad_of(stats.loss, lp), [[0.0, -0.5, -0.5]])
    assert math.isfinite(stats.counts.kl_ref)


def test_kl_estimators_are_bounded_as_in_verl():
    far = kl_penalty(torch.tensor([-100.0, 0.0, 0.0]), torch.tensor([0.0, -100.0, -5.0]), "k3")
    close(far, [10.0, 10.0, math.exp(-5) + 5 - 1])  # k3 at most 10, either way; below that as ever
    close(kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k2"), [200.0])
