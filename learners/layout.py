"""Where one micro-batch's tokens go in its rows: each token's flat position, and each response token's predictor.

Built from the rollouts' token lists with a few array operations per micro-batch (numpy over the
concatenated lists, no tensor per rollout): laying out a step is host work the GPU waits for, so a step of
128 rollouts must not cost hundreds of small tensor operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from asyncrl.wire.protocol import Rollout

Values = Sequence[Sequence[float] | torch.Tensor | float]  # per rollout: a number, or one per response token


class SharedPrefixes(NamedTuple):
    """Attention over a row whose prompts appear once (``learner.share_prompts``), as varlen kernels take it.

    The row's tokens are cut into query spans at ``query_starts``: a prompt's shared tokens, then each of its
    rollouts' own tokens. Span ``s`` attends to the keys ``key_index[key_starts[s]:key_starts[s + 1]]`` (token
    positions in the row): a prompt's shared tokens for its own span, the shared tokens then its own for a
    rollout's. Causal within each span, aligned to its last key (a rollout's first token sees the whole prompt).
    """

    query_starts: torch.Tensor
    key_starts: torch.Tensor
    key_index: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SharedPrefixes:
        return SharedPrefixes(*(t.to(device, non_blocking=non_blocking) for t in self))


def by_prompt(rollouts: list[Rollout]) -> dict[tuple[int, ...], list[int]]:
    """The rollouts' indices by prompt, prompts in the order they first appear."""
    prompts: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rollouts):
        prompts.setdefault(tuple(r.prompt_ids), []).append(i)
    return prompts


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``arange(s, s + n)`` for each ``(s, n)``, end to end."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def joined(lists: Iterable[Iterable], dtype: type) -> torch.Tensor:
    """One tensor of the lists' values end to end (through numpy: building it from a Python list is slower)."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(lists), dtype))


class Layout:
    """One micro-batch's layout: ``rows`` x ``width`` positions, and for its tokens in order (each rollout's
    prompt then response; a shared prompt once, before its rollouts) their ``ids``, ``position`` (within the
    rollout), ``owner`` (the rollout's index), and flat position ``token_at`` (None where they fill the
    positions from 0 on, as packed rows do). ``target_at``: the flat position that predicts each response
    token, rollouts in order; ``response``: each rollout's response length."""

    def __init__(self, rollouts: list[Rollout], packed: bool, shared: bool = False) -> None:
        self.response = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.long)
        self.prefix: SharedPrefixes | None = None
        self.token_at: torch.Tensor | None = None
        if shared and packed and rollouts:
            starts = self._share(rollouts)
        else:
            starts = self._whole(rollouts, packed)
        response = self.response.numpy()
        step = ranges(np.zeros_like(response), response)
        self.target_at = torch.from_numpy(np.repeat(starts, response) + step)

    def _whole(self, rollouts: list[Rollout], packed: bool) -> np.ndarray:
        """Every prompt in full: one row of rollouts end to end (packed), or a row per rollout (padded); returns
        where each rollout's last prompt token sits (flat)."""
        prompt = np.array([len(r.prompt_ids) for r in rollouts], dtype=np.int64)
        total = prompt + self.response.numpy()
        count, tokens = len(rollouts), int(total.sum())
        self.ids = joined((chain(r.prompt_ids, r.response_ids) for r in rollouts), np.int64)
        owner = np.repeat(np.arange(count), total)
        position = ranges(np.zeros_like(total), total)
        self.owner, self.position = torch.from_numpy(owner), torch.from_numpy(position)
        if packed and rollouts:
            self.rows, self.width = 1, tokens
            begins = np.cumsum(total) - total
        else:
            self.rows, self.width = max(count, 1), int(total.max()) if count else 2
            begins = np.arange(count) * self.width
            self.token_at = torch.from_numpy(begins[owner] + position)
        return begins + prompt - 1

    def _share(self, rollouts: list[Rollout]) -> np.ndarray:
        """One packed row where each prompt appears once: its tokens but the last, then per rollout of that
        prompt the last prompt token and the response (which therefore predicts the response's first token).
        Each rollout's tokens attend to the shared tokens and causally to their own (:class:`SharedPrefixes`);
        returns where each rollout's own tokens begin."""
        ids: list[int] = []
        # Per query span: its owner, first position and length; its keys, two ranges of the row (start, length):
        # the prompt's shared tokens, then its own (none for the shared span itself).
        owner, first, length, keys = [], [], [], []
        starts = np.zeros(len(rollouts), dtype=np.int64)
        for prompt, members in by_prompt(rollouts).items():
            shared, at = len(prompt) - 1, len(ids)
            if shared:
                ids.extend(prompt[:-1])
                owner.append(members[0]), first.append(0), length.append(shared), keys.append((at, shared, at, 0))
            for i in members:
                starts[i], own = len(ids), 1 + len(rollouts[i].response_ids)
                ids.append(prompt[-1])
                ids.extend(rollouts[i].response_ids)
                owner.append(i), first.append(shared), length.append(own), keys.append((at, shared, starts[i], own))
        length_of = np.array(length, dtype=np.int64)
        key_ranges = np.array(keys, dtype=np.int64).reshape(-1, 2)  # each span's two ranges, one after the other
        self.rows, self.width = 1, len(ids)
        self.ids = torch.from_numpy(np.array(ids, dtype=np.int64))
        self.owner = torch.from_numpy(np.repeat(np.array(owner, dtype=np.int64), length_of))
        self.position = torch.from_numpy(ranges(np.array(first, dtype=np.int64), length_of))
        self.prefix = SharedPrefixes(
            _bounds(length_of),
            _bounds(key_ranges[:, 1].reshape(-1, 2).sum(1)),
            torch.from_numpy(ranges(key_ranges[:, 0], key_ranges[:, 1])),
        )
        return starts

    def predicting(self) -> torch.Tensor:
        """The flat positions (in ``[rows * width]``) that predict a response token; position 0 where there is
        none, so that a rank with nothing left still runs the output projection its peers' collectives wait for."""
        return self.target_at if len(self.target_at) else torch.zeros(1, dtype=torch.long)

    def tokens(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``[rows, width]``: ``values`` (one per token) where the tokens are, ``fill`` elsewhere."""
        out = torch.full((self.rows * self.width,), fill, dtype=values.dtype)
        if self.token_at is None:
            out[: len(values)] = values
        else:
            out.index_copy_(0, self.token_at, values)  # not out[index] = ...: on CPU that is 100x slower
        return out.view(self.rows, self.width)

    def targets(self, values: torch.Tensor) -> torch.Tensor:
        """``[rows, width]``: ``values`` (one per response token, rollouts in order) where each is predicted."""
        out = torch.zeros(self.rows * self.width, dtype=values.dtype)
        return out.index_copy_(0, self.target_at, values).view(self.rows, self.width)

    def spread(self, values: Values) -> torch.Tensor:
        """Per-rollout values (a number, or one per response token) at each rollout's predicting positions."""
        return self.targets(flat_values(values, self.response))


def _bounds(lengths: np.ndarray) -> torch.Tensor:
    """Where each of the consecutive spans of ``lengths`` starts, and the end (int32, as varlen kernels take it)."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def flat_values(values: Values, lengths: torch.Tensor) -> torch.Tensor:
    """``values`` laid end to end (float32), a number repeated over its rollout's response tokens."""
    if all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in values):
        return torch.repeat_interleave(torch.tensor([float(v) for v in values]), lengths)
    parts = [torch.as_tensor(v, dtype=torch.float32).expand(int(n)) for v, n in zip(values, lengths)]
    return torch.cat(parts) if parts else torch.zeros(0)
