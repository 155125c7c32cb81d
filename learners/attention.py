"""Attention over packed rows: ``learner.attn_implementation: varlen``.

Packed rows hold many rollouts back to back, and attention must stay within
each one. ``varlen`` hands the whole row to torch's variable-length flash
attention (``torch.nn.attention.varlen.varlen_attn``) with the rollouts'
boundaries, so nothing is computed between rollouts, no mask is built and
nothing is compiled: the packed layout of flash-attn's ``varlen`` kernels,
from torch itself. Padded rows (the reference's and critic's per-token
passes, a rank's empty micro-batch) go through it as well, cut into each
row's tokens and its padding. On a CPU, where torch has no such kernel, each
segment goes through sdpa on its own, which gives the same numbers more slowly.

It is registered with transformers under the name ``varlen`` when this
module is imported, for attention and for the (empty) mask it needs.
"""

from __future__ import annotations

import functools
import inspect

import torch

VARLEN = "varlen"


@torch.compiler.disable  # learner.compile: one kernel (or a loop of sdpa on a CPU), run as it is between graphs
def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_k: int | None = None,
    key_index: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[rows, heads, T, dim]`` in, ``[rows, T, heads, dim]`` out.

    The rows are laid end to end and cut at ``cu_seq_lens_q`` (segment starts
    and the end), which :func:`segments` finds once per forward, with
    ``max_length_q``, the longest segment. With ``key_index`` (a row whose
    prompts appear once, :func:`shared_segments`) segment ``s`` attends to the
    tokens ``key_index[cu_seq_lens_k[s]:cu_seq_lens_k[s + 1]]``, causally
    from its last key back: its prompt's shared tokens, then its own.
    """
    if cu_seq_lens_q is None or attention_mask is not None:
        raise ValueError(
            "attn_implementation varlen takes the segments of learners.attention.segments and no "
            "attention mask (the learner's forward passes them)"
        )
    if dropout:
        raise ValueError(
            f"attn_implementation varlen has no dropout (the model asks for {dropout}): set "
            "learner.disable_dropout: true, or use the model's default attention"
        )
    for option in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(option) is not None:
            raise ValueError(
                f"attn_implementation varlen does not apply {option} (the model asks for it); "
                "use the model's default attention"
            )
    rows, heads, length, _ = query.shape
    q, k, v = (x.transpose(1, 2).reshape(rows * length, x.shape[1], x.shape[-1]) for x in (query, key, value))
    query_spans = (cu_seq_lens_q, int(max_length_q))
    key_spans = query_spans
    if key_index is not None:
        k, v = k.index_select(0, key_index), v.index_select(0, key_index)  # each span's keys, end to end
        key_spans = (cu_seq_lens_k, int(max_length_k))
    if q.is_cuda:
        out = _flash_varlen(q, k, v, query_spans, key_spans, scaling)
    else:
        out = _sdpa_per_segment(q, k, v, cu_seq_lens_q, key_spans[0], scaling)
    return out.view(rows, length, heads, out.shape[-1]), None


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: tuple, keys: tuple, scale: float | None
) -> torch.Tensor:
    """torch's flash varlen kernel, causal (``window_size (-1, 0)``: aligned to each span's last key)."""
    from torch.nn.attention.varlen import varlen_attn

    spans = (queries[0], keys[0], queries[1], keys[1])
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _varlen_options():
            return varlen_attn(q, k, v, *spans, scale=scale, window_size=(-1, 0), enable_gqa=True)
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))  # each query head its copy
    return varlen_attn(q, k, v, *spans, scale=scale, window_size=(-1, 0))


@functools.cache
def _varlen_options() -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes (they were added over releases)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def shared_spans_unavailable() -> str | None:
    """Why the flash varlen kernel cannot run rows that hold each prompt once (``learner.share_prompts``) here;
    None when it can. They need causal spans with fewer queries than keys aligned to the last key, as flash
    attention aligns them; one small span is checked against sdpa once per process."""
    if not torch.cuda.is_available():
        return None  # the CPU path is sdpa per span, aligned explicitly
    from torch.nn.attention.bias import causal_lower_right

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator) for n in (3, 7, 7))
    spans = [torch.tensor([0, n], device="cuda", dtype=torch.int32) for n in (3, 7)]
    try:
        out = _flash_varlen(q, k, v, (spans[0], 3), (spans[1], 7), None)
    except Exception as exc:  # noqa: BLE001  (an older torch's kernel: say why, and leave prompts whole)
        return f"torch's varlen_attn refused queries fewer than keys ({exc})"
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(0, 1).float() for x in (q, k, v)), attn_mask=causal_lower_right(3, 7)
    ).transpose(0, 1)
    if not torch.allclose(out.float(), expected, atol=2e-2):
        return "torch's varlen_attn aligns a causal span with fewer queries than keys otherwise than to its last key"
    return None


def kernel_unavailable(dtype: str) -> str | None:
    """Why torch's flash varlen kernel cannot run a model of ``dtype`` weights here; None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"the GPU's compute capability {torch.cuda.get_device_capability()} is below (8, 0)"
    try:
        options = _varlen_options()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if not {"scale", "window_size"} <= options:
        return f"torch {torch.__version__}'s varlen_attn takes no scale or window_size"
    if dtype not in ("bfloat16", "float16"):
        return f"model.dtype {dtype} (flash attention takes bf16 or fp16)"
    return None


def _sdpa_per_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_starts: torch.Tensor,
    key_starts: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The same attention on a CPU: causal sdpa over each segment's queries and keys, aligned to its last key."""
    from torch.nn.attention.bias import causal_lower_right

    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    spans = zip(query_starts.tolist(), query_starts.tolist()[1:], key_starts.tolist(), key_starts.tolist()[1:])
    for start, end, key_start, key_end in spans:
        qs = q[start:end].transpose(0, 1)  # [heads, length, dim]
        ks, vs = (x[key_start:key_end].transpose(0, 1) for x in (k, v))
        causal = {"is_causal": True} if end - start == key_end - key_start else {}
        mask = None if causal else causal_lower_right(end - start, key_end - key_start)
        if mask is not None and ks.shape[0] != qs.shape[0]:  # the bias does not take enable_gqa
            ks, vs = (x.repeat_interleave(qs.shape[0] // ks.shape[0], dim=0) for x in (ks, vs))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=ks.shape[0] != qs.shape[0], **causal
        ).transpose(0, 1)
    return out


def segments(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> dict:
    """The keyword arguments :func:`varlen_attention` needs: where each segment of the rows laid end to end starts.

    Packed rows (``position_ids`` ``[1, T]``, no mask): a segment per
    rollout, starting where its positions restart at 0. Right-padded rows
    (``attention_mask`` ``[rows, T]``): a segment per row's tokens and one per
    row's padding, whose outputs nothing reads. transformers passes these
    through the decoder to every attention layer, so they are found once per
    forward, not once per layer.
    """
    if attention_mask is not None:
        rows, length = attention_mask.shape
        lengths = attention_mask.sum(-1)
        columns = torch.arange(length, device=attention_mask.device)
        if not torch.equal(attention_mask.bool(), columns < lengths[:, None]):
            raise ValueError("attn_implementation varlen takes right-padded rows: each row's tokens, then padding")
        row_starts = torch.arange(rows, device=attention_mask.device) * length
        starts = torch.stack([row_starts, row_starts + lengths], -1).flatten()
        cu = torch.unique_consecutive(torch.cat([starts, starts.new_tensor([rows * length])]))
    elif position_ids is not None:
        if position_ids.shape[0] != 1:
            raise ValueError(f"attn_implementation varlen takes one packed row; got {position_ids.shape[0]} rows")
        row = position_ids[0]
        cu = torch.cat([torch.nonzero(row == 0).flatten(), row.new_tensor([row.numel()])])
    else:
        raise ValueError(
            "attn_implementation varlen needs an attention mask (padded rows) or position ids (packed rows)"
        )
    cu = cu.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def shared_segments(prefix) -> dict:
    """The keyword arguments :func:`varlen_attention` needs for a row whose prompts appear once
    (:class:`learners.layout.SharedPrefixes`): its query spans, and each span's keys."""
    query_starts, key_starts, key_index = prefix
    lengths = torch.stack([query_starts[1:] - query_starts[:-1], key_starts[1:] - key_starts[:-1]]).amax(-1).tolist()
    return {
        "cu_seq_lens_q": query_starts,
        "cu_seq_lens_k": key_starts,
        "max_length_q": lengths[0],
        "max_length_k": lengths[1],
        "key_index": key_index,
    }


def register() -> None:
    """Make ``varlen`` a name transformers accepts for ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    # Packed rows come without a padding mask, for which flash attention's mask function returns None.
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


register()
