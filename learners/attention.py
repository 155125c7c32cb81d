"""Attention over packed rows: ``learner.attn_implementation: varlen``.

Packed rows hold many rollouts back to back, and attention must stay within
each one. ``varlen`` hands the whole row to torch's variable-length flash
attention (``torch.nn.attention.varlen.varlen_attn``) with the rollouts'
boundaries, so nothing is computed between rollouts, no mask is built and
nothing is compiled: the packed layout of flash-attn's ``varlen`` kernels,
from torch itself. On a CPU, where torch has no such kernel, each rollout
goes through sdpa on its own, which gives the same numbers more slowly.

It is registered with transformers under the name ``varlen`` when this
module is imported, for attention and for the (empty) mask it needs.
"""

from __future__ import annotations

import inspect

import torch

VARLEN = "varlen"


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[1, heads, T, dim]`` in, ``[1, T, heads, dim]`` out.

    ``cu_seq_lens_q`` (the rollouts' starts and the row's end) and
    ``max_length_q`` come from :func:`packed_inputs`, once per forward.
    """
    if cu_seq_lens_q is None or attention_mask is not None or query.shape[0] != 1:
        raise ValueError("attn_implementation varlen takes one packed row with position ids and no attention mask "
                         "(learner.pack_sequences true)")
    if dropout:
        raise ValueError(f"attn_implementation varlen has no dropout (the model asks for {dropout})")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, dim]
    if q.is_cuda:
        out = _flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _sdpa_per_rollout(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, longest: int,
                  scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    options = _varlen_options()
    if "enable_gqa" in options:
        extra = {"enable_gqa": k.shape[1] != q.shape[1]}
    else:  # older torch: every query head gets its own copy of its key/value head
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        extra = {}
    extra.update({"window_size": (-1, 0)} if "window_size" in options else {"is_causal": True})
    return varlen_attn(q, k, v, starts, starts, longest, longest, scale=scale, **extra)


_OPTIONS: frozenset[str] | None = None


def _varlen_options() -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes (GQA and causality were added over releases)."""
    global _OPTIONS
    if _OPTIONS is None:
        from torch.nn.attention.varlen import varlen_attn

        _OPTIONS = frozenset(inspect.signature(varlen_attn).parameters)
    return _OPTIONS


def _sdpa_per_rollout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """The same attention on a CPU: causal sdpa over each rollout's slice of the row."""
    out = torch.empty_like(q)
    bounds = starts.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [heads, length, dim]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[0] != qs.shape[0]).transpose(0, 1)
    return out


def packed_inputs(position_ids: torch.Tensor) -> dict:
    """The keyword arguments :func:`varlen_attention` needs, from a packed row's ``position_ids`` ``[1, T]``.

    transformers passes them through the decoder to every attention layer, so
    the rollouts' boundaries are found once per forward, not once per layer.
    """
    if position_ids.shape[0] != 1:
        raise ValueError(f"attn_implementation varlen takes one packed row; got {position_ids.shape[0]} rows")
    row = position_ids[0]
    starts = torch.nonzero(row == 0).flatten()
    ends = torch.tensor([row.numel()], device=row.device)
    cu = torch.cat([starts, ends]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def register() -> None:
    """Make ``varlen`` a name transformers accepts for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    # Packed rows come without a padding mask, for which flash attention's mask function returns None.
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


register()
