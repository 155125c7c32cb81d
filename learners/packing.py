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


def by_prompt(rollouts: list[Rollout]) -> dict[tuple[int, ...], list[int]]:
    """The rollouts' indices by prompt, prompts in the order they first appear."""
    prompts: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rollouts):
        prompts.setdefault(tuple(r.prompt_ids), []).append(i)
    return prompts


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


class _Layout:
    """Where one micro-batch's tokens go: each rollout's row and column offset, as index tensors.

    Built once per micro-batch with vectorised arithmetic, so that packing a
    step of many short rollouts costs a handful of tensor operations rather
    than several per rollout.
    """

    def __init__(self, rollouts: list[Rollout], packed: bool, shared: bool = False) -> None:
        prompt = torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.long)
        response = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.long)
        self.response = response
        self.prefix: SharedPrefixes | None = None
        if shared and packed and rollouts:
            self._share(rollouts, response)
            return
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
        self.owner = owner

    def _share(self, rollouts: list[Rollout], response: torch.Tensor) -> None:
        """One packed row where each prompt appears once: its tokens but the last, then per rollout of that
        prompt the last prompt token and the response (which therefore predicts the response's first token).
        Each rollout's tokens attend to the shared tokens and causally to their own (:class:`SharedPrefixes`)."""
        prompts = by_prompt(rollouts)
        ids, positions, owners, query_lengths, keys = [], [], [], [], []
        starts = [0] * len(rollouts)  # where each rollout's own tokens begin in the row
        at = 0
        for prompt, members in prompts.items():
            shared = len(prompt) - 1
            context = torch.arange(at, at + shared)
            if shared:
                ids.append(torch.tensor(prompt[:-1]))
                positions.append(torch.arange(shared))
                owners.append(torch.full((shared,), members[0]))
                query_lengths.append(shared)
                keys.append(context)
                at += shared
            for i in members:
                own = 1 + len(rollouts[i].response_ids)
                starts[i] = at
                ids.append(torch.tensor([prompt[-1], *rollouts[i].response_ids]))
                positions.append(torch.arange(shared, shared + own))
                owners.append(torch.full((own,), i))
                query_lengths.append(own)
                keys.append(torch.cat([context, torch.arange(at, at + own)]))
                at += own
        self.rows, self.width = 1, at
        self.ids = torch.cat(ids).long()
        self.position = torch.cat(positions)
        self.owner = torch.cat(owners)
        self.token_row, self.token_col = torch.zeros(at, dtype=torch.long), torch.arange(at)
        self.response_owner = torch.repeat_interleave(torch.arange(len(rollouts)), response)
        step = torch.arange(int(response.sum())) - (torch.cumsum(response, 0) - response)[self.response_owner]
        self.target_row = torch.zeros_like(self.response_owner)
        self.target_col = torch.tensor(starts, dtype=torch.long)[self.response_owner] + step
        key_lengths = torch.tensor([len(k) for k in keys])
        query_starts = _starts(torch.tensor(query_lengths))
        self.prefix = SharedPrefixes(query_starts, _starts(key_lengths), torch.cat(keys))

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


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """Where each of the consecutive spans of ``lengths`` starts, and the end (int32, as varlen kernels take it)."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)


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


def _flat(values: Values, lengths: torch.Tensor) -> torch.Tensor:
    """``values`` laid end to end, a number repeated over its rollout's response tokens."""
    if all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in values):
        return torch.repeat_interleave(torch.tensor([float(v) for v in values]), lengths)
    parts = [torch.as_tensor(v, dtype=torch.float32).expand(int(n)) for v, n in zip(values, lengths)]
    return torch.cat(parts)


def place(rollouts: list[Rollout], packed: bool, values: Values, shared: bool = False) -> torch.Tensor:
    """Per-rollout values (a number, or one per response token) where :func:`pack` puts each response token."""
    return _Layout(rollouts, packed, shared).spread(values)


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
    layout = _Layout(rollouts, packed, shared)
    shape = (layout.rows, layout.width)
    ids = torch.zeros(shape, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long) if rollouts else torch.ones(shape, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    targets = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape)
    rows, cols = layout.token_row, layout.token_col
    ids[rows, cols] = (
        layout.ids
        if layout.prefix is not None
        else torch.tensor([t for r in rollouts for t in (*r.prompt_ids, *r.response_ids)], dtype=torch.long)
    )
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
        layout.owner[None] if packed_rows else None,
        layout.prefix,
    )


def response_values(
    values: torch.Tensor, rollouts: list[Rollout], packed: bool, shared: bool = False
) -> list[torch.Tensor]:
    """Per rollout, ``values`` at every one of its response tokens (the environment's in an episode too), from a
    micro-batch :func:`pack` laid out."""
    layout = _Layout(rollouts, packed, shared)
    return list(values[layout.target_row, layout.target_col].split(layout.response.tolist()))
