"""Loss aggregation: per-token values reduced to one micro-batch's share of the step's loss.

Padded ``[rows, T]`` tensors, or packed rows with ``segment_ids`` saying
which sequence each token belongs to. The normalisers are the whole step's,
passed in, so that the micro-batches' results add up to the step's loss.
"""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def segments(mask: torch.Tensor, segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Sequence index of every position, and the number of sequences: the row, unless packed."""
    if segment_ids is None:
        rows = torch.arange(mask.shape[0], device=mask.device)
        return rows.unsqueeze(-1).expand_as(mask), mask.shape[0]
    return segment_ids.long(), int(segment_ids.max()) + 1 if segment_ids.numel() else 0


def per_sequence_sum(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Each sequence's sum of ``x`` (``seg``: the sequence index of every position, of ``n`` sequences)."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seg.reshape(-1), x.reshape(-1))


def per_sequence_mean(x: torch.Tensor, m: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Each sequence's mean of ``x`` over its mask tokens (0 for a sequence without any)."""
    return per_sequence_sum(masked(x, m), seg, n) / per_sequence_sum(m, seg, n).clamp(min=1)


def masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` on mask tokens, 0 elsewhere: selected, not multiplied, so what lies outside the mask (a prompt
    token, padding) cannot turn the sum into NaN."""
    return torch.where(m.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode,
    *,
    num_tokens: float,
    num_sequences: float,
    horizon: float | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar, with the step's normalisers so micro-batch results add up.

    ``token-mean``: ``sum_tokens(v) / num_tokens``.
    ``seq-mean-token-sum``: ``sum_seq(sum_t v) / num_sequences``.
    ``seq-mean-token-mean``: ``sum_seq(mean_t v) / num_sequences`` (GRPO's original form).
    ``seq-mean-token-sum-norm``: ``sum_seq(sum_t v / horizon) / num_sequences``,
    a constant horizon (e.g. the maximum response length) in place of each
    length, as Dr. GRPO (Liu et al. 2025) prescribes. verl's version omits
    ``/ num_sequences``, a constant factor for a fixed batch size.

    The names are verl's. ``num_tokens`` / ``num_sequences`` count the mask
    tokens / non-empty sequences of the whole step (over every micro-batch
    and rank), so summing the micro-batch results gives the step's aggregate.
    A sequence must not be split across micro-batches. The learner passes
    them divided by the number of ranks, whose gradients DeepSpeed averages:
    with fewer sequences than ranks they are fractions, and stay so.
    """
    m = mask.to(values.dtype)
    kept = masked(values, m)
    if mode == "token-mean":
        return kept.sum() / (num_tokens or 1)
    seg, n = segments(mask, segment_ids)
    token_sums = per_sequence_sum(kept, seg, n)
    if mode == "seq-mean-token-sum":
        per_seq = token_sums
    elif mode == "seq-mean-token-mean":
        per_seq = per_sequence_mean(values, m, seg, n)
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive constant horizon")
        per_seq = token_sums / horizon
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return per_seq.sum() / (num_sequences or 1)
