"""Micro-batches for one optimizer step: grouping by a token budget, and the model inputs of each.

Pure functions over lists and tensors, so they are tested without an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from asyncrl.wire.protocol import Rollout
from learners.layout import Layout, SharedPrefixes, Values, by_prompt, joined

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import PretrainedConfig


def packed_attention_inputs(
    model_config: PretrainedConfig,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    prefix: SharedPrefixes | None = None,
) -> dict:
    """The attention arguments for the decoder: ``attention_mask``, and what packed rows need beside it.

    Under ``varlen``, padded and packed rows alike become segments
    (:func:`learners.attention.segments`), and a row whose prompts appear once
    (``prefix``) its spans and their keys; under flex attention packed rows
    get their block mask here. Other implementations confine attention to each
    rollout from ``position_ids`` themselves (flash attention's varlen
    kernels, sdpa's dense mask).
    """
    # _attn_implementation: the implementation transformers resolved when it loaded the model
    implementation = model_config._attn_implementation
    if prefix is not None and implementation != "varlen":
        raise ValueError(f"learner.share_prompts needs attn_implementation varlen, not {implementation}")
    if implementation == "varlen":
        from learners.attention import segments, shared_segments

        check_packable(model_config)
        found = shared_segments(prefix) if prefix is not None else segments(attention_mask, position_ids)
        return {"attention_mask": None, **found}
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


def shared_microbatches(rollouts: list[Rollout], max_tokens: int) -> list[list[int]]:
    """:func:`microbatches` for rows that hold each prompt once: whole prompts' groups where they fit, each
    costing its prompt once and every response one token more (the prompt's last, repeated)."""
    prompts = by_prompt(rollouts)
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for prompt, members in prompts.items():
        for i in members:
            own = 1 + len(rollouts[i].response_ids)
            opens = not current or rollouts[current[-1]].prompt_ids != rollouts[i].prompt_ids  # the prefix again
            cost = own + (len(prompt) - 1 if opens else 0)
            if current and used + cost > max_tokens:
                batches.append(current)
                current, used, cost = [], 0, own + len(prompt) - 1
            current.append(i)
            used += cost
    if current:
        batches.append(current)
    return batches


def place(rollouts: list[Rollout], packed: bool, values: Values, shared: bool = False) -> torch.Tensor:
    """Per-rollout values (a number, or one per response token) where :func:`pack` puts each response token."""
    return Layout(rollouts, packed, shared).spread(values)


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
    # Packed rows: the rollout (its index in the micro-batch) each position belongs to; None for padded rows.
    owner: torch.Tensor | None = None
    # Packed rows whose prompts appear once (learner.share_prompts): what attention needs to see them.
    prefix: SharedPrefixes | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """Every tensor on ``device``."""
        return MicroBatch(*(t if t is None else t.to(device, non_blocking=non_blocking) for t in self))

    def logprob_options(self) -> dict:
        """The log-prob forward's keyword arguments for this micro-batch (``prefix`` only where prompts are shared)."""
        return {"predicting": self.predicting, **({} if self.prefix is None else {"prefix": self.prefix})}


def pack(
    rollouts: list[Rollout], packed: bool = False, advantages: Values | None = None, shared: bool = False
) -> MicroBatch:
    """Model inputs for one micro-batch; targets and masks cover response tokens only.

    Padded: one right-padded row per rollout, with an attention mask.
    Packed: all rollouts back to back in one row, with position ids that
    restart at every rollout and no attention mask, so no token is spent on
    padding and no rollout attends to another. ``advantages`` (one per
    rollout in: a number, or a tensor with one value per response token)
    comes out per token, where each rollout's tokens are.

    ``shared`` (packed rows only): each prompt once, followed by the responses to it
    (:class:`SharedPrefixes`), so a group of eight costs one prompt's tokens, not eight.

    An empty list gives one fully masked row: a rank with nothing left to do
    still runs the forward and backward its peers' collectives wait for.
    """
    layout = Layout(rollouts, packed, shared)
    targets = joined((r.response_ids for r in rollouts), np.int64)
    behaviour = joined((r.logprobs for r in rollouts), np.float32)
    # The model's tokens only: an episode's environment replies are context, not actions.
    mask = joined((r.loss_mask or [1] * len(r.response_ids) for r in rollouts), np.float32)
    packed_rows = packed and bool(rollouts)
    attention = None if packed_rows else layout.tokens(torch.ones_like(layout.ids), fill=int(not rollouts))
    return MicroBatch(
        layout.tokens(layout.ids),
        attention,
        layout.tokens(layout.position) if packed_rows else None,
        layout.targets(targets),
        layout.targets(behaviour),
        layout.targets(mask),
        layout.spread(advantages) if advantages is not None else torch.zeros(layout.rows, layout.width),
        layout.predicting(),
        layout.owner[None] if packed_rows else None,
        layout.prefix,
    )


def response_values(
    values: torch.Tensor, rollouts: list[Rollout], packed: bool, shared: bool = False
) -> list[torch.Tensor]:
    """Per rollout, ``values`` at every one of its response tokens (the environment's in an episode too), from a
    micro-batch :func:`pack` laid out."""
    layout = Layout(rollouts, packed, shared)
    return list(values.reshape(-1)[layout.target_at].split(layout.response.tolist()))
