"""Micro-batches for one optimizer step: grouping by a token budget, and the model inputs of each.

Pure functions over lists and tensors, so they are tested without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from asyncrl.wire.protocol import Rollout

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import PretrainedConfig


def packed_attention_inputs(
    model_config: PretrainedConfig, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
) -> dict:
    """The attention arguments for the decoder: ``attention_mask``, and what packed rows need beside it.

    Under ``varlen``, padded and packed rows alike become segments
    (:func:`learners.attention.segments`); under flex attention packed rows
    get their block mask here. Other implementations confine attention to each
    rollout from ``position_ids`` themselves (flash attention's varlen
    kernels, sdpa's dense mask).
    """
    # _attn_implementation: the implementation transformers resolved when it loaded the model
    implementation = model_config._attn_implementation
    if implementation == "varlen":
        from learners.attention import segments

        check_packable(model_config)
        return {"attention_mask": None, **segments(attention_mask, position_ids)}
    if attention_mask is not None or position_ids is None:
        return {"attention_mask": attention_mask}
    check_packable(model_config)
    if implementation == "flex_attention":
        return {"attention_mask": document_block_mask(position_ids)}
    return {"attention_mask": None}


def check_packable(model_config: PretrainedConfig) -> None:
    """Refuse packed rows under flex attention or ``varlen`` for a model with sliding-window layers.

    transformers hands the block mask it is given to every layer unchanged, and
    :func:`document_block_mask` has no window; ``varlen`` attends to the whole
    rollout. Either way those layers would attend past their window.
    """
    implementation = model_config._attn_implementation
    if implementation in ("flex_attention", "varlen") and has_sliding_window(model_config):
        what, instead = (
            ("packed rows' block mask", "or learner.pack_sequences false")
            if implementation == "flex_attention"
            else ("varlen", "or leave it unset (the model's default attention)")
        )
        raise ValueError(
            f"learner.attn_implementation {implementation}: {model_config.model_type} has sliding-window attention "
            f"(sliding_window {model_config.sliding_window}), which {what} does not apply; use attn_implementation "
            f"flash_attention_2, {instead}"
        )


def has_sliding_window(model_config: PretrainedConfig) -> bool:
    """Whether some layer of the model attends within a sliding window."""
    layer_types = getattr(model_config, "layer_types", None)
    return getattr(model_config, "sliding_window", None) is not None and (
        layer_types is None or "sliding_attention" in layer_types
    )


def document_block_mask(position_ids: torch.Tensor, block: int = 128) -> BlockMask:
    """Flex attention's block mask for packed rows: causal within each rollout, nothing across rollouts.

    ``position_ids`` (``[rows, T]``) restart at 0 where each rollout begins.
    Built from the rollouts' boundaries with a few tensor operations over
    ``T / block`` blocks, with no dense ``T x T`` mask and nothing to compile.
    transformers' own route, ``create_block_mask``, compiles a kernel that
    sorts each row of blocks in registers; for a row of about 15k tokens
    (SmolLM2's step in one micro-batch) ``ptxas`` ran for minutes on an H200
    and the first step never finished.
    """
    from torch.nn.attention.flex_attention import BlockMask

    length = position_ids.shape[1]
    blocks = -(-length // block)
    rollout = (position_ids == 0).long().cumsum(-1) - 1  # which rollout each token belongs to
    first = rollout[:, ::block]  # rollout of each block's first and last token (the ids only ever grow)
    last = rollout[:, torch.clamp(torch.arange(1, blocks + 1, device=rollout.device) * block, max=length) - 1]
    q_first, q_last = first[:, :, None], last[:, :, None]
    kv_first, kv_last = first[:, None, :], last[:, None, :]
    below = torch.ones(blocks, blocks, dtype=torch.bool, device=rollout.device).tril()
    strictly_below = below.tril(-1)
    # Some pair of a query block and an earlier key block shares a rollout: the key block ends in or after
    # the query block's first rollout. Every pair does: both blocks lie within one rollout, keys before queries
    # (a key block wholly before the query block that starts in the query block's rollout also ends in it).
    some = below & (kv_last >= q_first)
    every = strictly_below & (q_first == q_last) & (kv_first == q_first)
    partial = some & ~every

    def indices(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = present.sum(-1, dtype=torch.int32)
        order = torch.argsort((~present).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # present first
        return count[:, None], order[:, None]

    padded = torch.nn.functional.pad(rollout, (0, blocks * block - length), value=-1)

    def same_rollout_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (padded[b, q] == padded[b, kv]) & (kv <= q)

    return BlockMask.from_kv_blocks(
        *indices(partial), *indices(every), BLOCK_SIZE=block, mask_mod=same_rollout_causal, seq_lengths=(length, length)
    )


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


class _Layout:
    """Where one micro-batch's tokens go: each rollout's row and column offset, as index tensors.

    Built once per micro-batch with vectorised arithmetic, so that packing a
    step of many short rollouts costs a handful of tensor operations rather
    than several per rollout.
    """

    def __init__(self, rollouts: list[Rollout], packed: bool) -> None:
        prompt = torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.long)
        response = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.long)
        total = prompt + response
        count = len(rollouts)
        starts = torch.cumsum(total, 0) - total  # where each rollout begins when laid end to end
        if packed and rollouts:
            self.rows, self.width = 1, int(total.sum())
            row, at = torch.zeros(count, dtype=torch.long), starts
        else:
            self.rows, self.width = max(count, 1), int(total.max()) if count else 2
            row, at = torch.arange(count), torch.zeros(count, dtype=torch.long)
        # Every token of every rollout: its owner, and its position within the rollout.
        owner = torch.repeat_interleave(torch.arange(count), total)
        self.position = torch.arange(int(total.sum())) - starts[owner]
        self.token_row, self.token_col = row[owner], at[owner] + self.position
        # Every response token: position t predicts token t + 1, so the response is predicted from p - 1 on.
        self.response_owner = torch.repeat_interleave(torch.arange(count), response)
        step = torch.arange(int(response.sum())) - (torch.cumsum(response, 0) - response)[self.response_owner]
        self.target_row = row[self.response_owner]
        self.target_col = (at + prompt - 1)[self.response_owner] + step
        self.response = response

    def predicting(self) -> torch.Tensor:
        """The flat positions (in ``[rows * width]``) that predict a response token; position 0 where there is
        none, so that a rank with nothing left still runs the output projection its peers' collectives wait for."""
        if not len(self.target_row):
            return torch.zeros(1, dtype=torch.long)
        return self.target_row * self.width + self.target_col

    def spread(self, values: Values) -> torch.Tensor:
        """Per-rollout values (a number, or one per response token) at each rollout's predicting positions."""
        out = torch.zeros(self.rows, self.width)
        if len(self.response):
            out[self.target_row, self.target_col] = _flat(values, self.response)
        return out


Values = Sequence[Sequence[float] | torch.Tensor | float]  # per rollout: a number, or one per response token


def _flat(values: Values, lengths: torch.Tensor) -> torch.Tensor:
    """``values`` laid end to end, a number repeated over its rollout's response tokens."""
    if all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in values):
        return torch.repeat_interleave(torch.tensor([float(v) for v in values]), lengths)
    parts = [torch.as_tensor(v, dtype=torch.float32).expand(int(n)) for v, n in zip(values, lengths)]
    return torch.cat(parts)


def place(rollouts: list[Rollout], packed: bool, values: Values) -> torch.Tensor:
    """Per-rollout values (a number, or one per response token) where :func:`pack` puts each response token."""
    return _Layout(rollouts, packed).spread(values)


class MicroBatch(NamedTuple):
    """One micro-batch's model inputs and what its loss reads, ``[rows, T]`` each (from :func:`pack`)."""

    ids: torch.Tensor
    attention_mask: torch.Tensor | None  # padded rows (None for packed ones)
    position_ids: torch.Tensor | None  # packed rows, restarting at 0 at every rollout (None for padded ones)
    targets: torch.Tensor  # the token each position predicts (0 where none is trained)
    behaviour: torch.Tensor  # the sampler's log-prob of each target
    mask: torch.Tensor  # 1 where a response token of the model's own is predicted
    advantages: torch.Tensor  # per token
    # The flat positions (in ``[rows * T]``) that predict a response token, the only ones whose log-probs a
    # step reads (the prompt's are context); position 0 in an empty micro-batch.
    predicting: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """Every tensor on ``device``."""
        return MicroBatch(*(t if t is None else t.to(device, non_blocking=non_blocking) for t in self))


def pack(rollouts: list[Rollout], packed: bool = False, advantages: Values | None = None) -> MicroBatch:
    """Model inputs for one micro-batch; targets and masks cover response tokens only.

    Padded: one right-padded row per rollout, with an attention mask.
    Packed: all rollouts back to back in one row, with position ids that
    restart at every rollout and no attention mask, so no token is spent on
    padding and no rollout attends to another. ``advantages`` (one per
    rollout in: a number, or a tensor with one value per response token)
    comes out per token, where each rollout's tokens are.

    An empty list gives one fully masked row: a rank with nothing left to do
    still runs the forward and backward its peers' collectives wait for.
    """
    layout = _Layout(rollouts, packed)
    shape = (layout.rows, layout.width)
    ids = torch.zeros(shape, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long) if rollouts else torch.ones(shape, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    targets = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape)
    rows, cols = layout.token_row, layout.token_col
    ids[rows, cols] = torch.tensor([t for r in rollouts for t in (*r.prompt_ids, *r.response_ids)], dtype=torch.long)
    attention[rows, cols] = 1
    positions[rows, cols] = layout.position
    targets[layout.target_row, layout.target_col] = torch.tensor(
        [t for r in rollouts for t in r.response_ids], dtype=torch.long
    )
    # The model's tokens only: an episode's environment replies are context, not actions.
    mask[layout.target_row, layout.target_col] = torch.tensor(
        [m for r in rollouts for m in (r.loss_mask or [1] * len(r.response_ids))], dtype=mask.dtype
    )
    behaviour = torch.zeros(shape)
    behaviour[layout.target_row, layout.target_col] = torch.tensor([x for r in rollouts for x in r.logprobs])
    token_advantages = layout.spread(advantages) if advantages is not None else torch.zeros(shape)
    packed_rows = packed and bool(rollouts)
    return MicroBatch(
        ids,
        None if packed_rows else attention,
        positions if packed_rows else None,
        targets,
        behaviour,
        mask,
        token_advantages,
        layout.predicting(),
    )


def response_values(values: torch.Tensor, rollouts: list[Rollout], packed: bool) -> list[torch.Tensor]:
    """Per rollout, ``values`` at every one of its response tokens (the environment's in an episode too), from a
    micro-batch :func:`pack` laid out."""
    layout = _Layout(rollouts, packed)
    return list(values[layout.target_row, layout.target_col].split(layout.response.tolist()))
