"""The learner's config sections: the learner group (optimisation, DeepSpeed, checkpoints) and the algorithm.

A field's ``#`` comments are its ``--help`` text, as in :mod:`asyncrl.config.sections`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from asyncrl.config.sections import Section


class LoraConfig(Section):
    """Low-rank adapters (peft's LoRA): the learner trains only the adapter, the base frozen, and generators
    load only the adapter of each version. Off while ``rank`` is 0."""

    rank: int = 0  # > 0: train a LoRA adapter of this rank instead of every weight
    alpha: float = 32.0  # the adapter's scale is alpha / rank
    # the modules that get an adapter: peft's "all-linear" (every linear layer but the output head), or names
    # such as [q_proj, k_proj, v_proj, o_proj]
    target_modules: str | list[str] = "all-linear"
    dropout: float = 0.0  # kept 0 by learner.disable_dropout, as generators sample with none

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LearnerConfig(Section):
    """The learner group: optimisation and the DeepSpeed engine."""

    groups_per_step: int = 8
    total_steps: int = 100
    max_train_s: float = 0.0  # > 0: also finish once this many seconds have passed since the first batch
    # Also finish once the mean training reward of the last stop_window_steps steps reaches this (as Ray Tune's
    # stop={"reward_mean": ...}); the window counts the steps of this process (a resumed run starts it anew).
    stop_at_reward: float | None = None
    stop_window_steps: int = 20
    publish_every_steps: int = 1
    # Write each version's folder on a thread while the next step trains, from the CPU copy every publish
    # takes; false: the step waits for the write. The push transport has push.background for the same.
    background_publish: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    # Optimizer updates per step: the step's batch splits into mini_batches of whole groups, an optimizer step
    # each, and epochs passes go over it; the version is published after the last (verl's ppo_mini_batch_size
    # = groups_per_step / mini_batches and ppo_epochs; TRL's steps_per_generation and num_iterations;
    # OpenRLHF's max_epochs). Each update takes its PPO ratio against the behaviour log-probs, so the clip
    # bounds how far one batch's updates move the policy; with an algo.off_policy correction, against the
    # learner's own log-probs from before the step (AReaL's proximal policy: one more forward pass a step,
    # without gradients). More updates learn more from each sample, at the learner's cost: worth it where
    # the learner would otherwise wait for the generators.
    mini_batches: int = 1
    epochs: int = 1  # passes over the step's batch, each in mini_batches (above)
    max_tokens_per_microbatch: int = 8192
    # Micro-batch rollouts back to back in one row, attention kept within each rollout, so no compute goes
    # to padding. auto: packed rows under attn_implementation varlen (torch's variable-length flash
    # attention) where all of these hold: a CUDA GPU of compute capability 8.0 or later, a torch whose
    # varlen_attn takes scale and window_size, bf16/fp16 weights, attn_implementation unset or varlen, and
    # no sliding-window layers; padded rows otherwise (every CPU run). Packed rows also run under
    # flex_attention or flash_attention_2; under sdpa the packed row's mask makes attention quadratic in
    # the whole row (0.45x the padded rows on CPU, bench/README.md).
    pack_sequences: bool | Literal["auto"] = "auto"
    # transformers' attn_implementation, or varlen (packed or padded rows; on a CPU each rollout through
    # sdpa alone); None: transformers' default (sdpa), or varlen where pack_sequences auto packs.
    attn_implementation: str | None = None
    # Packed rows under varlen attention hold each prompt once, followed by the responses to it: a group of
    # eight 100-token prompts with 22-token answers costs 276 tokens instead of 976, in the forward and the
    # backward. Each response attends to its prompt as it would alone, so the numbers are the same. auto: on
    # wherever pack_sequences settles on packed rows under varlen and torch's kernel passes a check of how it
    # aligns a short span (once per process); true: on, or an error naming what is missing.
    share_prompts: bool | Literal["auto"] = "auto"
    logprob_chunk_tokens: int = 1024
    # Trained rollouts kept with every token (ids, behaviour log-probs, versions, loss mask, advantages) in
    # RUN_DIR/rollouts.jsonl for `asyncrl view` and notebooks: this many per step, spread over its groups
    # (0: none); writing stops once the file holds rollout_sample_max_mb.
    rollout_samples_per_step: int = 4
    rollout_sample_max_mb: float = 200.0
    gradient_checkpointing: bool = False
    # Dropout off in the learner's models (every dropout probability in the model's config, and every
    # torch.nn.Dropout, set to 0), as the generators sample with none: the learner's log-probs then match
    # theirs. false: the model's own dropout (GPT-2's 0.1) in training, which makes the ratio to the behaviour
    # policy, mismatch_kl and the KL to the reference noisy from the first step; varlen attention refuses it.
    disable_dropout: bool = True
    # Liger's fused Triton kernels for RMSNorm, SwiGLU and RoPE in the learner's models (GPU; the log-prob
    # loss is chunked already): 1.06-1.12x the learner's tokens/s on one H200 (bench/README.md). auto: on
    # with a CUDA GPU, liger-kernel installed, a model type Liger covers and no ZeRO-3 partitioning (not
    # yet run under it); true: on, or an error naming what is missing.
    liger_kernels: bool | Literal["auto"] = "auto"
    # torch.compile the policy's decoder layers (regional compilation, dynamic shapes: one graph serves every
    # layer and every micro-batch's length), so a step launches a few fused kernels per layer instead of
    # dozens of small ones; the first forward and backward are compiled before the first batch arrives, while
    # the generators sample it. Liger's kernels stay off under it unless set to true (the compiler fuses the
    # same operations). Stages 0-2 only: ZeRO-3 gathers each layer's parameters through hooks a compiled
    # layer would not call.
    compile: bool = False
    # None: 3 with several ranks. One rank has nothing to shard, and ZeRO-3's hooks cost a fifth of a
    # small model's step on CPU and half of it on one GPU: 0 in fp32, 1 with bf16 weights, which is
    # DeepSpeed's bf16 optimizer (fp32 master weights and gradients in flat buffers; without ZeRO its
    # 16-bit optimizer handles every tensor on its own and waits on the GPU for each).
    zero_stage: Literal[0, 1, 2, 3] | None = None
    # ZeRO's reduce and stage-3 prefetch buckets (the live-parameter limit is 4 of them), in elements as
    # DeepSpeed counts them: 5e8 is its own default, 1 GB per bucket in bf16.
    zero_bucket_elements: int = 500_000_000
    zero_persistence_threshold: int = 1_000_000  # stage 3: parameters smaller than this stay whole
    # stage 3: modules with fewer parameters per descendant than this are fetched as one unit (0: off)
    zero_module_granularity: int = 0
    zero_allreduce_fetch: bool = False  # stage 3: fetch parameters with all-reduce instead of all-gather
    deepspeed_config: str | None = None  # a JSON file that replaces the generated one
    # None: `asyncrl run` gives each rank an equal share of the cores (under --ray: ray.learner_cpus);
    # a learner started on its own uses torch's default (every core).
    torch_threads: int | None = None
    batch_timeout_s: float = 120.0
    # A step still running after this many seconds logs every thread's Python stack (0: off), so a step that
    # waits forever says where (a compile, a collective, a lock); each report doubles the next limit.
    stall_report_s: float = 300.0
    weights_dir: str | None = None  # defaults to <run_dir>/weights; /dev/shm is fastest
    # Hand each version to the generators in shared memory on this machine instead of a folder: CUDA IPC
    # when they share the learner's GPU, a /dev/shm file on CPU. None: on when learner.devices and
    # generator.devices name the same single GPU (the one-GPU mode) and learner.lora is off; false: folders.
    shared_weights: bool | None = None
    keep_versions: int = 3
    devices: str | int | None = None  # asyncrl run: CUDA_VISIBLE_DEVICES of the learner group ("0" or "0,1")
    ranks: int = 1  # learner processes (data parallel, ZeRO-partitioned); >1 starts them with torchrun
    checkpoint_every_steps: int = 0  # 0: only on SIGTERM
    # When asyncrl run (with or without --ray) stops early (Ctrl-C, SIGTERM, an error, --timeout-s), the
    # learner finishes its step and checkpoints within this; a ZeRO-3 checkpoint of a large model takes a while.
    stop_timeout_s: float = 120.0
    keep_checkpoints: int = 2
    # asyncrl run --ray only (a plain `asyncrl run` ignores it): a learner that fails is started
    # again with --resume from this run's last checkpoint up to this many times, and the
    # generators keep running and rejoin it. Needs checkpoint_every_steps > 0.
    restarts: int = 0
    seed: int = 0
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


TOKEN_REWARD_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")  # returns built token by token


class AlgoConfig(Section):
    """The policy-gradient algorithm: advantage estimator, policy loss, off-policy correction.

    The formulas, and the papers they follow, are in ``learners/advantages.py``
    and ``learners/policy_loss.py``. The defaults are GRPO advantages with
    PPO-clip against the generator's (behaviour) log-probs, token mean.
    """

    # gae: PPO with a critic (a value model trained beside the policy) and GAE
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    reward_scaling: Literal["group", "batch", "none"] | None = None  # group estimators; None: the estimator's own
    clip_eps: float = 0.2  # PPO clip, low side (and high side unless clip_eps_high is set)
    clip_eps_high: float | None = None  # DAPO's clip-higher, e.g. 0.28
    # dual-clip PPO's c (> 1 + clip_eps_high): a negative-advantage token's loss is at most -c * A, however far
    # its ratio (null: no bound)
    dual_clip: float | None = 3.0
    ratio_level: Literal["token", "sequence"] = "token"  # sequence: GSPO
    seq_clip_eps: float = 3e-4  # GSPO's clip range
    seq_clip_eps_high: float | None = 4e-4
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    entropy_coef: float = 0.0  # entropy bonus
    kl_coef: float = 0.0  # > 0: KL to a frozen, ZeRO-partitioned copy of the starting policy, in the loss
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # reward: the penalty in the reward (REINFORCE++ and GAE: per token; group estimators: summed)
    kl_in: Literal["loss", "reward"] = "loss"
    # Correction for tokens sampled by older (or numerically different) generator weights:
    # tis (truncated importance sampling), decoupled (AReaL's decoupled PPO), icepop (token
    # mask outside [mask_low, mask_high]), seq_mask (sequence mask by geometric-mean ratio).
    off_policy: Literal["none", "tis", "decoupled", "icepop", "seq_mask"] = "none"
    is_cap: float = 2.0  # tis / decoupled: C
    mask_low: float = 0.5  # icepop / seq_mask: the kept ratio band
    mask_high: float = 5.0
    gamma: float = 1.0  # gae: discount
    lam: float = 0.95  # gae: lambda
    critic_lr: float = 1e-5  # gae: the critic's learning rate
    value_clip: float | None = 0.2  # gae: PPO's value clip around the critic's values before the step
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill the batch
    # dynamic sampling stops the run once one step has dropped this many batches' worth of groups without
    # filling its batch (every reward equal, or failing); 0: wait for ever
    dynamic_sampling_max_rounds: int = 10
    # DAPO's soft overlong penalty: within this many tokens of generator.max_new_tokens the reward
    # falls linearly by up to overlong_penalty (0: off).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


def step_checks(learner: LearnerConfig) -> list[tuple[bool, str, str]]:
    """How a step runs: ``learner.mini_batches`` and ``learner.epochs`` against the batch, ``learner.compile``
    against the ZeRO stage."""
    stage = learner.zero_stage if learner.zero_stage is not None else 3 if learner.ranks > 1 else 0
    return [
        (
            not learner.compile or stage < 3,
            "learner.compile",
            "runs at ZeRO stages 0-2 only (several ranks take stage 3 unless learner.zero_stage says otherwise): "
            "ZeRO-3 gathers each layer's parameters through hooks that a compiled layer would not call",
        ),
        (
            1 <= learner.mini_batches <= learner.groups_per_step,
            "learner.mini_batches",
            "must be in [1, learner.groups_per_step]: a mini-batch holds whole groups",
        ),
        (learner.epochs >= 1, "learner.epochs", "must be >= 1"),
    ]
