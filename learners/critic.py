"""PPO's critic: a value model trained beside the policy (``algo.advantage: gae``).

The critic is its own network, as in OpenRLHF and verl: the policy's
starting weights without the LM head, and a linear value head initialised
to zero. It has its own DeepSpeed engine (partitioned like the policy) and
optimizer (``algo.critic_lr``). The value at position ``t`` estimates the
return from the state that predicts token ``t + 1``: the same positions the
policy's log-probs sit at, so values, log-probs and advantages line up token
for token. With ``learner.lora`` the critic's decoder is frozen too and trains
an adapter of its own (the policy's rank and targets) beside its value head,
so a LoRA run keeps no optimizer state for a whole second model.
"""

from __future__ import annotations

import torch

from asyncrl.config import AlgoConfig, LearnerConfig, ModelConfig
from learners.packing import packed_attention_inputs


class ValueModel(torch.nn.Module):
    """A causal decoder and a scalar head; ``forward`` returns one value per position."""

    def __init__(self, decoder: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids=None, prefix=None) -> torch.Tensor:
        attention = packed_attention_inputs(self.decoder.config, attention_mask, position_ids, prefix)
        hidden = self.decoder(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def build_critic(config: LearnerConfig, model_config: ModelConfig, algo: AlgoConfig):
    """The critic's DeepSpeed engine, initialised from the policy's starting weights."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    from learners.engine import adamw, deepspeed_config, restart_step_counts, skip_lone_allreduce
    from learners.masters import set_master_weights
    from learners.models import DTYPES, load_causal_lm

    ds_config = deepspeed_config(config, model_config)
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841  (partitions at creation, like the policy)
    lm = load_causal_lm(config, model_config)
    if config.lora.enabled:
        from asyncrl.weights.adapters import with_adapter

        with_adapter(
            lm, config.lora, config.disable_dropout
        )  # in place: the decoder's layers gain the adapter, the base freezes
    critic = ValueModel(lm.get_decoder(), lm.config.hidden_size)
    dtype = DTYPES[model_config.resolved_dtype()]
    critic.value_head.to(dtype)
    engine, *_ = deepspeed.initialize(model=critic, optimizer=adamw(critic, config, algo.critic_lr), config=ds_config)
    restart_step_counts(engine)
    skip_lone_allreduce(engine)
    if dtype != torch.float32 and not config.lora.enabled:  # the decoder's fp32 masters, as the policy's
        names = {id(param): name for name, param in lm.named_parameters()}
        set_master_weights(
            engine, {names[id(p)]: p for p in critic.decoder.parameters() if id(p) in names}, model_config.path
        )
    return engine


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    num_tokens: float,
) -> torch.Tensor:
    """PPO's clipped value loss, ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``, token mean over the step.

    ``num_tokens`` is the step's count, so micro-batch losses add up to the
    step's mean; ``clip`` None is the plain squared error.
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum() / (num_tokens or 1)
