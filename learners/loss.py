"""Chunked log-probs of the policy's own tokens (the loss itself is in :mod:`learners.policy_loss`).

Log-probs are computed ``logprob_chunk_tokens`` positions at a time, each
chunk under activation checkpointing, so the full-vocabulary logits of a
micro-batch never exist at once: only one chunk's logits are alive in the
forward pass and again in the backward pass.

Within a chunk, everything after the output projection (temperature,
log-softmax, the target's pick, the entropy, and their gradients) is one
autograd function whose forward and backward each read the logits in their
own dtype and write no full-vocabulary float32 tensor. It is used on a GPU,
where both halves are compiled (torch.compile fuses each into a few reduction
kernels) and separate float32 ops would write and read the chunk's
full-vocabulary logits several times over. On CPU, run eagerly, it is slower
than torch's own log-softmax kernels under autograd, which CPU runs keep
(:func:`autograd_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.utils.checkpoint import checkpoint


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32 at least (bf16 logits are reduced in float32)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _logprob_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float):
    """Log-prob of each target, entropy and log-sum-exp of ``logits * inv_temperature`` (float32 at least)."""
    z = _widened(logits) * inv_temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    log_p = z - lse.unsqueeze(-1)
    entropy = -(torch.exp(log_p) * log_p).sum(-1)  # never below 0, unlike lse - sum(p * z) in float32
    return picked, entropy, lse


def _logprob_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_picked: torch.Tensor,
    grad_entropy: torch.Tensor,
    inv_temperature: float,
) -> torch.Tensor:
    """Gradient of the logits, in their dtype.

    With ``z = logits * inv_temperature``, ``p = softmax(z)`` and ``H`` the entropy:
    ``d picked / dz = onehot(target) - p`` and ``dH / dz = -p * (log p + H)``.
    """
    z = _widened(logits) * inv_temperature
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    onehot = torch.arange(z.shape[-1], device=z.device) == targets.unsqueeze(-1)
    grad_z = grad_picked.unsqueeze(-1) * (onehot.to(z.dtype) - p) - grad_entropy.unsqueeze(-1) * p * (
        log_p + entropy.unsqueeze(-1)
    )
    return (grad_z * inv_temperature).to(logits.dtype)


@functools.cache
def _kernels(device_type: str):
    """The two halves, compiled on a GPU (shapes dynamic: a micro-batch's last chunk is shorter)."""
    if device_type != "cuda":
        return _logprob_stats, _logprob_grad
    return torch.compile(_logprob_stats, dynamic=True), torch.compile(_logprob_grad, dynamic=True)


class _LogprobsFromLogits(torch.autograd.Function):
    """``log_softmax(logits / T)`` at the targets, and the entropy, with a hand-written backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool):
        stats, _ = _kernels(logits.device.type)
        picked, entropy, lse = stats(logits, targets, 1.0 / temperature)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.inv_temperature = 1.0 / temperature
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_picked: torch.Tensor, grad_entropy: torch.Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(entropy)
        _, grad = _kernels(logits.device.type)
        return grad(logits, targets, lse, entropy, grad_picked, grad_entropy, ctx.inv_temperature), None, None, None


def autograd_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :class:`_LogprobsFromLogits` computes, as separate float32 ops differentiated by autograd."""
    log_p = torch.log_softmax(_widened(logits) / temperature, dim=-1)
    picked = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_p.exp() * log_p).sum(-1)
    return picked, entropy


@dataclasses.dataclass(frozen=True)
class LogitsHead:
    """What a model's own ``forward`` does to ``lm_head``'s output, and vLLM does too before sampling.

    ``softcap``: ``cap * tanh(logits / cap)`` (Gemma 2 and 3's ``final_logit_softcapping``); then ``scale``
    multiplies the logits (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``). Without them the
    learner's log-probs would differ from the generator's on every token of these models.
    """

    softcap: float | None = None
    scale: float = 1.0

    @classmethod
    def of(cls, model_config) -> LogitsHead:
        """From a transformers config (a multimodal model's text config where it has one)."""
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        scale = float(getattr(text, "logit_scale", None) or 1.0) / float(getattr(text, "logits_scaling", None) or 1.0)
        return cls(softcap=getattr(text, "final_logit_softcapping", None) or None, scale=scale)


PLAIN_HEAD = LogitsHead()


def _chunk_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    head: LogitsHead = PLAIN_HEAD,
):
    logits = lm_head(hidden)
    if head.softcap is not None:
        logits = head.softcap * torch.tanh(_widened(logits) / head.softcap)
    temperature = temperature / head.scale  # a scale folds into the temperature: z = logits * scale / T
    if not logits.is_cuda:  # eager, the fused forward+backward is 1.6-1.8x slower (bench/logprob_tail_bench.py)
        return autograd_logprobs(logits, targets, temperature, entropy_grad)
    return _LogprobsFromLogits.apply(logits, targets, temperature, entropy_grad and torch.is_grad_enabled())


def token_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
    head: LogitsHead = PLAIN_HEAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy at each position.

    ``hidden`` is ``[batch, seq, dim]`` (the states that predict ``targets``,
    ``[batch, seq]``). The result equals ``log_softmax(head(lm_head(hidden)) / temperature)``
    gathered at ``targets``, computed ``chunk_tokens`` positions at a time.
    The entropy carries gradients only with ``entropy_grad`` (an entropy bonus).
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    picked, entropy = [], []
    for start in range(0, flat_h.shape[0], chunk_tokens):
        h, t = flat_h[start : start + chunk_tokens], flat_t[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            p, e = checkpoint(_chunk_logprobs, lm_head, h, t, temperature, entropy_grad, head, use_reentrant=False)
        else:
            p, e = _chunk_logprobs(lm_head, h, t, temperature, entropy_grad, head)
        picked.append(p)
        entropy.append(e)
    shape = targets.shape
    return torch.cat(picked).view(shape), torch.cat(entropy).view(shape)
