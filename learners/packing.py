"""Micro-batches for one optimizer step: grouping by a token budget, and the model inputs of each.

Pure functions over lists and tensors, so they are tested without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.protocol import Rollout


def microbatches(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Group sample indices so that each micro-batch's tokens stay within ``max_tokens``.

    Padded, a micro-batch costs rows x longest row; packed, the sum of its
    lengths. A sample longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        cost = used + lengths[i] if packed else (len(current) + 1) * lengths[i]
        if current and cost > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


def _layout(rollouts: list[Rollout], packed: bool) -> tuple[int, int, list[tuple[int, int]]]:
    """Rows and width of a micro-batch, and each rollout's ``(row, offset)``."""
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    if packed and rollouts:
        return 1, sum(lengths), [(0, sum(lengths[:k])) for k in range(len(rollouts))]
    return max(len(rollouts), 1), max(lengths, default=2), [(row, 0) for row in range(len(rollouts))]


Values = Sequence[Sequence[float] | torch.Tensor | float]  # per rollout: a number, or one per response token


def place(rollouts: list[Rollout], packed: bool, values: Values) -> torch.Tensor:
    """Per-rollout values (a number, or one per response token) where :func:`pack` puts each response token."""
    rows, width, placements = _layout(rollouts, packed)
    out = torch.zeros(rows, width)
    for (row, at), r, value in zip(placements, rollouts, values):
        p, n = len(r.prompt_ids), len(r.response_ids)
        out[row, at + p - 1: at + p + n - 1] = torch.as_tensor(value, dtype=torch.float32)
    return out


def pack(rollouts: list[Rollout], packed: bool = False, advantages: Values | None = None):
    """Model inputs for one micro-batch; targets and masks cover response tokens only.

    Padded: one right-padded row per rollout, with an attention mask.
    Packed: all rollouts back to back in one row, with position ids that
    restart at every rollout and no attention mask, so no token is spent on
    padding and no rollout attends to another. Returns ``(ids, attention_mask,
    position_ids, targets, behaviour, mask, advantages)``; the unused one of
    ``attention_mask``/``position_ids`` is None, and ``advantages`` (one per
    rollout in: a number, or a tensor with one value per response token) comes
    out per token, where each rollout's tokens are.

    An empty list gives one fully masked row: a rank with nothing left to do
    still runs the forward and backward its peers' collectives wait for.
    """
    rows, width, placements = _layout(rollouts, packed)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.ones(rows, width, dtype=torch.long) if not rollouts else torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width)
    for (row, at), r in zip(placements, rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[row, at: at + p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        attention[row, at: at + p + n] = 1
        positions[row, at: at + p + n] = torch.arange(p + n)
        # Position t predicts token t + 1: the response is predicted from p - 1 on.
        targets[row, at + p - 1: at + p + n - 1] = torch.tensor(r.response_ids)
        mask[row, at + p - 1: at + p + n - 1] = 1
    behaviour = place(rollouts, packed, [r.logprobs for r in rollouts])
    token_advantages = place(rollouts, packed, advantages) if advantages is not None else torch.zeros(rows, width)
    if packed and rollouts:
        return ids, None, positions, targets, behaviour, mask, token_advantages
    return ids, attention, None, targets, behaviour, mask, token_advantages
