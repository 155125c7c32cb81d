"""GRPO advantages, chunked log-probs and the PPO-clip policy loss.

Log-probs are computed ``logprob_chunk_tokens`` positions at a time, each
chunk under activation checkpointing, so the full-vocabulary logits of a
micro-batch never exist at once: only one chunk's logits are alive in the
forward pass and again in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's standard deviation.

    A group whose rewards are all equal carries no signal and gets zeros.
    """
    r = torch.tensor(rewards, dtype=torch.float32)
    out = torch.zeros_like(r)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for members in groups.values():
        idx = torch.tensor(members)
        values = r[idx]
        if len(members) > 1:
            out[idx] = (values - values.mean()) / (values.std() + eps)
    return out


def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = lm_head(hidden).float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked, entropy


def token_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy at each position.

    ``hidden`` is ``[batch, seq, dim]`` (the states that predict ``targets``,
    ``[batch, seq]``). The result equals ``log_softmax(lm_head(hidden))``
    gathered at ``targets``, computed ``chunk_tokens`` positions at a time.
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    picked, entropy = [], []
    for start in range(0, flat_h.shape[0], chunk_tokens):
        h, t = flat_h[start:start + chunk_tokens], flat_t[start:start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            p, e = checkpoint(_chunk_logprobs, lm_head, h, t, temperature, use_reentrant=False)
        else:
            p, e = _chunk_logprobs(lm_head, h, t, temperature)
        picked.append(p)
        entropy.append(e)
    shape = targets.shape
    return torch.cat(picked).view(shape), torch.cat(entropy).view(shape)


@dataclass
class PolicyLossStats:
    loss: torch.Tensor
    clip_fraction: float
    approx_kl: float
    entropy: float
    kl_ref: float = 0.0


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    clip_eps: float,
    num_tokens: float,
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> PolicyLossStats:
    """PPO-clip against the behaviour log-probs, summed over tokens / ``num_tokens``.

    Dividing by the step's total token count (not the micro-batch's) makes
    the sum over micro-batches the token mean over the whole step. With
    ``reference_logprobs``, ``kl_coef`` times the k3 estimate of
    KL(policy || reference), ``exp(d) - d - 1`` with ``d = ref - policy``
    (non-negative, unbiased, low variance), is added per token.
    """
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    # One advantage per row (padded rows), or one per token (packed rows hold several rollouts).
    adv = advantages if advantages.dim() == logprobs.dim() else advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = -(surrogate * mask).sum() / num_tokens
    kl_ref = None
    if reference_logprobs is not None:
        delta = reference_logprobs - logprobs
        kl_ref = torch.exp(delta) - delta - 1
        loss = loss + kl_coef * (kl_ref * mask).sum() / num_tokens
    with torch.no_grad():
        m = mask.bool()
        clipped = ((ratio - 1).abs() > clip_eps) & m
        n = max(int(m.sum()), 1)
        stats = dict(
            clip_fraction=float(clipped.sum()) / n,
            approx_kl=float(((ratio - 1) - log_ratio)[m].sum()) / n,
            entropy=float(entropy[m].sum()) / n,
            kl_ref=float(kl_ref[m].sum()) / n if kl_ref is not None else 0.0,
        )
    return PolicyLossStats(loss=loss, **stats)
