"""Chunked log-probs of the policy's own tokens (the loss itself is in :mod:`learners.policy_loss`).

Log-probs are computed ``logprob_chunk_tokens`` positions at a time, each
chunk under activation checkpointing, so the full-vocabulary logits of a
micro-batch never exist at once: only one chunk's logits are alive in the
forward pass and again in the backward pass.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy_grad: bool = False):
    logits = lm_head(hidden).float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked, entropy


def token_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy at each position.

    ``hidden`` is ``[batch, seq, dim]`` (the states that predict ``targets``,
    ``[batch, seq]``). The result equals ``log_softmax(lm_head(hidden))``
    gathered at ``targets``, computed ``chunk_tokens`` positions at a time.
    The entropy carries gradients only with ``entropy_grad`` (an entropy bonus).
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    picked, entropy = [], []
    for start in range(0, flat_h.shape[0], chunk_tokens):
        h, t = flat_h[start:start + chunk_tokens], flat_t[start:start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            p, e = checkpoint(_chunk_logprobs, lm_head, h, t, temperature, entropy_grad, use_reentrant=False)
        else:
            p, e = _chunk_logprobs(lm_head, h, t, temperature, entropy_grad)
        picked.append(p)
        entropy.append(e)
    shape = targets.shape
    return torch.cat(picked).view(shape), torch.cat(entropy).view(shape)
