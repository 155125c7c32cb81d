"""Token-level policy loss: PPO clip variants, off-policy corrections, KL and entropy terms.

Pure functions over padded ``[rows, T]`` tensors (or packed rows, with
``segment_ids`` saying which sequence each token belongs to). Three sets of
log-probs of the same sampled tokens may take part:

* ``logprobs``: the policy being trained (carries the gradient);
* ``behaviour_logprobs``: the generator's, under the weights it sampled with;
* ``proximal_logprobs``: the learner's own, under the weights before this
  step (decoupled PPO's proximal policy; for TIS, the "learner old" policy).

With ``off_policy="none"`` the PPO ratio is taken against the proximal
log-probs when given, else against the behaviour ones (plain PPO on the
generator's numbers). Every correction takes the ratio against the proximal
policy and lets the behaviour policy in only through a detached per-token
weight or mask; without proximal log-probs the detached current ones stand
in for them, so the ratio is 1 in value and the loss is an importance-weighted
policy gradient.

Aggregation (:mod:`learners.aggregation`) divides by normalisers of the
whole optimizer step (``num_tokens``, ``num_sequences``), passed in, so that
the sum of the micro-batch losses is the loss of the step. Statistics come back as sums and
counts (``LossCounts``), which add across micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from learners.aggregation import AggMode, aggregate, per_sequence_mean, per_sequence_sum, segments

OffPolicy = Literal["none", "tis", "decoupled", "icepop", "seq_mask"]
KLEstimator = Literal["k1", "k2", "k3"]
RatioLevel = Literal["token", "sequence"]
# Log-ratios (policy to anchor, proximal to behaviour, policy to reference) are clamped to +-20 and k3 to
# 10, verl's bounds: exp(20) is far past any clip, and exp(89) already overflows float32.
MAX_LOG_RATIO = 20.0
MAX_K3 = 10.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """The loss's options; defaults give the PPO-clip token mean the learner used before.

    * ``eps_low`` / ``eps_high``: ratio clip ``[1 - eps_low, 1 + eps_high]``;
      a larger ``eps_high`` is DAPO's clip-higher (Yu et al. 2025). None: ``eps_low``.
    * ``dual_clip``: constant c > 1 of dual-clip PPO (Ye et al. 2020), bounding
      the loss of negative-advantage tokens at ``-c * A``; None disables it.
    * ``ratio_level``: ``sequence`` is GSPO (Zheng et al. 2025), clipped with
      ``seq_eps_low`` / ``seq_eps_high`` (the paper's 3e-4 / 4e-4).
    * ``off_policy``: the correction for behaviour != proximal, see ``policy_loss``;
      ``is_cap`` is C for ``tis`` / ``decoupled``, ``[band_low, band_high]``
      the kept ratio band for ``icepop`` / ``seq_mask`` (IcePop uses [0.5, 5];
      sequence masks usually a much narrower band).
    * ``kl_coef`` x ``kl_estimator`` KL to the reference policy in the loss;
      ``entropy_coef`` x entropy subtracted from it.
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    dual_clip: float | None = None
    ratio_level: RatioLevel = "token"
    seq_eps_low: float = 3e-4
    seq_eps_high: float | None = 4e-4
    agg: AggMode = "token-mean"
    off_policy: OffPolicy = "none"
    is_cap: float = 2.0
    band_low: float = 0.5
    band_high: float = 5.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        choices = {"ratio_level": RatioLevel, "agg": AggMode, "off_policy": OffPolicy, "kl_estimator": KLEstimator}
        for name, kind in choices.items():
            if getattr(self, name) not in kind.__args__:
                raise ValueError(f"{name} must be one of {kind.__args__}, not {getattr(self, name)!r}")
        if not (0 <= self.eps_low < 1 and 0 <= self.seq_eps_low < 1 and min(self.clip_high, self.seq_clip_high) >= 0):
            raise ValueError("clip epsilons must be non-negative and eps_low < 1")
        if self.dual_clip is not None and self.dual_clip <= 1 + self.clip_high:
            raise ValueError(f"dual_clip must exceed 1 + eps_high (= {1 + self.clip_high}), not {self.dual_clip}")
        if self.is_cap <= 0 or not 0 <= self.band_low <= self.band_high:
            raise ValueError("need is_cap > 0 and 0 <= band_low <= band_high")

    @property
    def clip_high(self) -> float:
        return self.eps_low if self.eps_high is None else self.eps_high

    @property
    def seq_clip_high(self) -> float:
        return self.seq_eps_low if self.seq_eps_high is None else self.seq_eps_high


@dataclass(frozen=True)
class LossCounts:
    """Sums and counts over one micro-batch's mask tokens; ``a + b`` merges micro-batches (or ranks).

    Every field is a sum except ``is_ratio_max`` (merged with max). The
    properties turn them into the logged means. ``mismatch_kl`` and the IS
    ratio compare the proximal (else the detached current) log-probs with the
    behaviour ones: ``r = exp(prox - behav)``, whatever ``off_policy`` is.
    """

    tokens: float = 0.0  # mask tokens
    sequences: float = 0.0  # sequences with at least one mask token
    clipped_tokens: float = 0.0  # A > 0 and ratio > 1 + eps_high, or A < 0 and ratio < 1 - eps_low (GSPO: s_i)
    dual_clipped_tokens: float = 0.0  # A < 0 and ratio > dual_clip
    approx_kl_sum: float = 0.0  # k3 of the ratio's anchor vs the policy: (ratio - 1) - log ratio
    mismatch_kl_sum: float = 0.0  # k3 of behaviour vs proximal: (r - 1) - log r
    is_ratio_sum: float = 0.0  # r, before any truncation or masking
    is_ratio_max: float = 0.0
    masked_tokens: float = 0.0  # tokens whose weight the correction truncated or zeroed
    entropy_sum: float = 0.0
    kl_ref_sum: float = 0.0  # the configured estimator of KL(policy || reference)

    def __add__(self, other: LossCounts) -> LossCounts:
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        merged["is_ratio_max"] = max(self.is_ratio_max, other.is_ratio_max)
        return LossCounts(**merged)

    def _mean(self, total: float) -> float:
        return total / self.tokens if self.tokens else 0.0

    clip_fraction = property(lambda self: self._mean(self.clipped_tokens))
    dual_clip_fraction = property(lambda self: self._mean(self.dual_clipped_tokens))
    approx_kl = property(lambda self: self._mean(self.approx_kl_sum))
    mismatch_kl = property(lambda self: self._mean(self.mismatch_kl_sum))
    is_ratio_mean = property(lambda self: self._mean(self.is_ratio_sum))
    masked_fraction = property(lambda self: self._mean(self.masked_tokens))
    entropy = property(lambda self: self._mean(self.entropy_sum))
    kl_ref = property(lambda self: self._mean(self.kl_ref_sum))

    def summary(self) -> dict[str, float]:
        """The per-token means (and the max ratio) to log."""
        names = (
            "clip_fraction",
            "dual_clip_fraction",
            "approx_kl",
            "mismatch_kl",
            "is_ratio_mean",
            "masked_fraction",
            "entropy",
            "kl_ref",
        )
        return {**{n: getattr(self, n) for n in names}, "is_ratio_max": self.is_ratio_max}


@dataclass
class PolicyLossStats:
    """The micro-batch's loss (to backward) and its statistics as sums and counts."""

    loss: torch.Tensor
    counts: LossCounts


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy (Schulman 2020).

    With ``d = log p - log ref``: ``k1 = d`` (unbiased, can be negative),
    ``k2 = d^2 / 2`` (biased, low variance), ``k3 = exp(-d) + d - 1``
    (unbiased, non-negative, low variance). Used in the loss here, and by
    REINFORCE++ as a penalty in the reward (``advantages.reinforce_pp``).
    Unbiased is said of the value: as a loss, k1's gradient is 0 in
    expectation (so the config refuses it there), k2's is that of
    KL(policy || ref) and k3's that of KL(ref || policy). ``d`` is clamped to
    +-20 and k3 to 10, as verl does, so a token the policy has moved far
    from the reference cannot overflow the loss.
    """
    d = (logprobs - reference_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (torch.exp(-d) + d - 1).clamp(max=MAX_K3)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def _correction(
    config: PolicyLossConfig, log_r: torch.Tensor, m: torch.Tensor, seg: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached per-token weight of the policy-gradient term, and which tokens it truncated or zeroed.

    ``log_r = prox - behav``, detached. ``tis`` (Yao et al. 2025): weight
    ``min(r, C)``. ``decoupled`` (AReaL, Fu et al. 2025): weight ``r``, and
    tokens with ``r > C`` are dropped, as AReaL filters them. ``icepop``:
    weight 1 inside ``[band_low, band_high]``, 0 outside. ``seq_mask``: the
    same band applied to each sequence's geometric-mean ratio
    ``exp(mean_t log r)``, dropping whole sequences.
    """
    r = torch.exp(log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    ones = torch.ones_like(r)
    if config.off_policy == "none":
        return ones, torch.zeros_like(r, dtype=torch.bool)
    if config.off_policy == "tis":
        return r.clamp(max=config.is_cap), r > config.is_cap
    if config.off_policy == "decoupled":
        dropped = r > config.is_cap
        return torch.where(dropped, 0.0, r), dropped
    if config.off_policy == "icepop":
        dropped = (r < config.band_low) | (r > config.band_high)
    else:  # seq_mask
        g = torch.exp(per_sequence_mean(log_r, m, seg, n))[seg]
        dropped = (g < config.band_low) | (g > config.band_high)
    return torch.where(dropped, 0.0, ones), dropped


def _loss_counts(
    config: PolicyLossConfig,
    m: torch.Tensor,
    seg: torch.Tensor,
    n: int,
    *,
    adv: torch.Tensor,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    low: float,
    high: float,
    prox: torch.Tensor,
    behaviour: torch.Tensor,
    corrected: torch.Tensor,
    entropy: torch.Tensor | None,
    kl_ref: torch.Tensor | None,
) -> LossCounts:
    """:func:`policy_loss`'s statistics over the mask tokens, from the tensors it built; no gradient flows.

    ``low`` / ``high`` are the clip bounds ``ratio`` was clipped to, ``corrected`` the tokens
    :func:`_correction` truncated or zeroed.
    """
    with torch.no_grad():
        valid = m.bool()
        rho = ratio.detach()
        is_ratio = torch.exp(prox - behaviour)
        zero = torch.zeros_like(m)
        dual = (adv < 0) & (rho > config.dual_clip) if config.dual_clip is not None else zero
        per_token = {
            "tokens": m,
            "clipped_tokens": ((adv > 0) & (rho > high)) | ((adv < 0) & (rho < low)),
            "dual_clipped_tokens": dual,
            "approx_kl_sum": torch.exp(log_ratio.detach()) - 1 - log_ratio.detach(),
            "mismatch_kl_sum": is_ratio - 1 - (prox - behaviour),
            "is_ratio_sum": is_ratio,
            "masked_tokens": corrected,
            "entropy_sum": entropy.detach() if entropy is not None else zero,
            "kl_ref_sum": kl_ref.detach() if kl_ref is not None else zero,
        }
        sums = torch.stack([torch.where(valid, x.double(), 0.0).sum() for x in per_token.values()])
        peak = torch.where(valid, is_ratio, 0.0).max() if valid.numel() else torch.zeros(())
        sequences = (per_sequence_sum(m, seg, n) > 0).sum()
        # One device-to-host copy for all statistics.
        values = torch.cat([sums, peak.double().reshape(1), sequences.double().reshape(1)]).tolist()
        counts = LossCounts(**dict(zip(per_token, values)), is_ratio_max=values[-2], sequences=values[-1])
    return counts


def _ratio(
    config: PolicyLossConfig,
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    m: torch.Tensor,
    seg: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, float, float]:
    """The policy ratio of every token, and the bounds it is clipped to.

    Per token, ``exp(log_ratio)`` within ``[1 - eps_low, 1 + eps_high]``; with ``ratio_level="sequence"``
    (GSPO-token) the sequence's geometric-mean ratio carried by each token's own gradient, within the
    ``seq_eps_*``.
    """
    if config.ratio_level == "token":
        return torch.exp(log_ratio), 1 - config.eps_low, 1 + config.clip_high
    seq_ratio = torch.exp(per_sequence_mean(log_ratio, m, seg, n))[seg].detach()
    return seq_ratio * torch.exp(logprobs - logprobs.detach()), 1 - config.seq_eps_low, 1 + config.seq_clip_high


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    num_tokens: float,
    num_sequences: float,
    horizon: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    reference_kl: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> PolicyLossStats:
    """The clipped policy-gradient loss of one micro-batch, plus KL and entropy terms, aggregated.

    Per token, with ``rho`` the ratio and ``A`` the advantage:
    ``pg = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))`` (PPO,
    Schulman et al. 2017; asymmetric clip-higher of DAPO), and for ``A < 0``
    with dual clip ``pg = min(pg, -c * A)`` (Ye et al. 2020). The token loss
    is ``w * pg + kl_coef * kl_t - entropy_coef * H_t``, ``w`` the detached
    off-policy weight (see ``_correction``), which the KL and entropy terms
    do not take. Tokens a correction zeroes still count in ``num_tokens``.

    ``ratio_level="sequence"`` is GSPO-token (Zheng et al. 2025):
    ``rho_t = sg[s_i] * exp(logp_t - sg[logp_t])`` with
    ``s_i = exp(mean_t(logp - anchor))``, clipped with the ``seq_eps_*``; with
    ``agg="seq-mean-token-mean"`` its gradient is GSPO's.

    ``advantages``: ``[rows, T]`` per token, or one per sequence (``[rows]``
    padded, ``[num sequences]`` packed). ``mask``: 1 on response tokens.
    ``segment_ids`` (packed rows only): ``[rows, T]`` sequence index of each
    position, 0-based and unique within the micro-batch. ``entropy`` must
    carry gradients for the bonus to act. ``reference_kl`` (``[rows, T]``, instead
    of ``reference_logprobs``): the KL to the reference measured before the
    step, reported as ``kl_ref`` and not in the loss (``algo.kl_in: reward``).
    """
    if config.kl_coef and reference_logprobs is None:
        raise ValueError("kl_coef is set but no reference log-probs were given")
    if config.entropy_coef and entropy is None:
        raise ValueError("entropy_coef is set but no entropy was given")
    m = mask.to(logprobs.dtype)
    seg, n = segments(mask, segment_ids)
    adv = advantages[seg] if advantages.dim() == 1 else advantages
    adv = adv.to(logprobs.dtype).detach()
    behaviour = behaviour_logprobs.detach()
    prox = proximal_logprobs.detach() if proximal_logprobs is not None else logprobs.detach()
    if config.off_policy == "none":
        anchor = proximal_logprobs.detach() if proximal_logprobs is not None else behaviour
    else:
        anchor = prox

    log_ratio = (logprobs - anchor).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # no overflow to inf, as in verl
    ratio, low, high = _ratio(config, logprobs, log_ratio, m, seg, n)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    if config.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * config.dual_clip), pg)

    weight, corrected = _correction(config, prox - behaviour, m, seg, n)
    token_loss = weight * pg
    kl_ref = reference_kl
    if reference_logprobs is not None:
        kl_ref = kl_penalty(logprobs, reference_logprobs.detach(), config.kl_estimator)
        if config.kl_coef:
            token_loss = token_loss + config.kl_coef * kl_ref
    if entropy is not None and config.entropy_coef:
        token_loss = token_loss - config.entropy_coef * entropy
    loss = aggregate(
        token_loss,
        mask,
        config.agg,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        horizon=horizon,
        segment_ids=segment_ids,
    )

    counts = _loss_counts(
        config,
        m,
        seg,
        n,
        adv=adv,
        ratio=ratio,
        log_ratio=log_ratio,
        low=low,
        high=high,
        prox=prox,
        behaviour=behaviour,
        corrected=corrected,
        entropy=entropy,
        kl_ref=kl_ref,
    )
    return PolicyLossStats(loss=loss, counts=counts)
