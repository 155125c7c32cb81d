"""The per-process sections of a run's config: one msgspec Struct per process or shared concern.

Each section checks its own fields' types; what spans sections is checked by
:class:`asyncrl.config.run.RunConfig`. A field's ``#`` comments are its
``--help`` text (:func:`asyncrl.config.describe.describe_keys` reads them from
this file), so they are written for the user.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """An invalid configuration; the message names the file and the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    """The policy's starting weights: an HF-format folder."""

    path: str = "assets/tiny-llama"
    # auto: bfloat16 where a GPU is visible (the learner keeps float32 master weights), float32 on CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    random_init: bool = False  # build from the folder's config.json alone (benchmarks)

    def resolved_dtype(self) -> str:
        """``dtype``, with ``auto`` decided by this process's hardware."""
        if self.dtype != "auto":
            return self.dtype
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"


class RemoteRewardConfig(_Section):
    """A reward model behind HTTP, used when ``task.reward`` is an http(s):// URL."""

    timeout_s: float = 30.0  # per attempt
    retries: int = 3  # attempts after the first (connection errors, timeouts, 408/429/5xx)
    backoff_s: float = 0.5  # first wait between attempts; doubles each time, plus jitter
    max_backoff_s: float = 8.0
    max_in_flight: int = 8  # open requests per generator process
    max_samples_per_request: int = 0  # 0: a whole group per request
    token_file: str | None = None  # bearer token; never the token itself in the config


DIGIT_PROMPTS = "asyncrl.tasks.digits:digit_prompts"
DIGIT_REWARD = "asyncrl.tasks.digits:digit_reward"


class TaskConfig(_Section):
    """Where prompts come from and how responses are scored.

    Prompts come from ``dataset`` (a JSONL or Parquet file, a
    ``save_to_disk`` folder or a cached hub dataset; rows read by
    ``input_key`` and ``label_key``), or, with ``dataset`` unset, from the
    ``prompts`` hook: a ``module:callable`` called as ``prompts(**prompt_args)``
    that returns a list of dicts with at least a ``prompt`` key. A reward is
    called as ``reward(response, item)`` with the response text and the
    item's dict (``label`` holds the row's label) and returns a float in
    ``[0, max_reward]``: a built-in name (``math``, ``format``, ``countdown``)
    or a ``module:callable``; ``rewards`` maps several to weights and sums them.
    A dataset needs ``reward`` or ``rewards``: only the built-in digit prompts
    (the default ``prompts``) are scored by the digit reward when neither is set.
    """

    dataset: str | None = None  # JSONL/Parquet file, save_to_disk folder, or a hub name in the local cache
    split: str = "train"  # dataset's split (hub datasets and DatasetDict folders)
    # eval_dataset's split, as TRL's dataset_test_split: so one DatasetDict folder or hub name can be both
    # dataset (its train split) and eval_dataset (its test split); a source without it is an error naming this key
    eval_split: str = "test"
    input_key: str = "prompt"  # the row's prompt text
    # the row's label; a GSM8K solution's label is what follows its last ####; a dotted key reads a nested column
    # (verl's reward_model.ground_truth), as input_key does
    label_key: str = "answer"
    system_prompt: str | None = None
    apply_chat_template: bool = False  # the tokenizer's own template, with the generation prompt added
    # longer prompts are skipped and counted; unset with generator.vllm.max_model_len set, prompts the engine
    # would refuse (max_model_len tokens or more) are skipped all the same
    max_prompt_tokens: int | None = None
    eval_dataset: str | None = None  # held-out prompts (same keys); or carve eval_fraction out of dataset
    eval_fraction: float = 0.0
    seed: int = 0  # the eval_fraction split
    prompts: str = DIGIT_PROMPTS
    prompt_args: dict[str, Any] = {}
    # a built-in name (math, format, countdown), module:callable or a reward model's http(s):// URL; must be set
    # (or rewards) with a dataset or a prompts hook of your own; unset, the digit prompts get the digit reward
    reward: str | None = None
    rewards: dict[str, float] = {}  # name or module:callable -> weight; set, it replaces reward
    # per sample (per group for a reward that scores a group in one call, like a reward model): a reward that
    # takes longer fails (advantage 0) and is counted
    reward_timeout_s: float = 10.0
    remote_reward: RemoteRewardConfig = msgspec.field(default_factory=RemoteRewardConfig)
    max_reward: float = 1.0
    # the run stops, naming why rewards failed, when its first this many steps had no reward scored at all (a
    # reward with the wrong signature, a reward server that is not there); 0: it trains on (advantages of 0)
    unscored_steps_to_fail: int = 5

    def reward_name(self) -> str | None:
        """``reward``, else the digit reward for the built-in digit prompts; None where the user must name one
        (a dataset scored by the digit-copy reward would train on noise without a word)."""
        if self.reward is not None:
            return self.reward
        return DIGIT_REWARD if self.dataset is None and self.prompts == DIGIT_PROMPTS else None


class EvalConfig(_Section):
    """Held-out evaluation, run by the generators while training goes on (needs held-out prompts)."""

    every_steps: int = 0  # 0: off; else at the start, every this many steps, and at the end
    k: int = 4  # samples per prompt for pass@k (>= 2), besides the greedy one for pass@1
    temperature: float = 1.0  # of the k samples
    max_items: int | None = None  # the first this many held-out prompts; unset: all
    items_per_request: int = 16  # prompts per piece handed to one generator
    max_new_tokens: int | None = None  # unset: generator.max_new_tokens
    final_timeout_s: float = 600.0  # how long the learner waits for the final evaluation at the end


class StalenessConfig(_Section):
    """The hard per-sample bound; 0 is synchronous on-policy training."""

    max_staleness: int = 1
    # A sample found over the bound when its batch is formed: dropped, or kept and weighted by
    # the learner's off-policy correction (algo.off_policy, which must then not be none).
    on_exceed: Literal["drop", "correct"] = "drop"


class BufferConfig(_Section):
    """The rollout transport between generators and learners."""

    type: Literal["zmq", "inproc", "redis"] = "zmq"  # inproc: within one process (tests), not for asyncrl run
    address: str = "tcp://127.0.0.1:5555"  # zmq: the learner binds it; inproc: a queue name
    capacity: int = 1024  # rollouts queued between the two sides
    timeout_s: float = 30.0
    # An entry larger than this is rejected before it is decoded (a 128k-token rollout is about 2 MB).
    max_message_bytes: int = 16 * 2**20
    curve_secret_file: str | None = None  # zmq: required when binding off loopback
    # redis: the stream, its consumer group and the connection
    redis_url: str = "redis://127.0.0.1:6379/0"  # rediss:// for TLS
    redis_username: str | None = None  # an ACL user
    redis_password_file: str | None = None  # read at start; never put the password in the config
    stream: str = "asyncrl:rollouts"
    consumer_group: str = "learners"
    consumer: str = "learner-0"  # stable across restarts, so a resumed learner gets its pending entries back
    claim_idle_s: float = 60.0  # pending entries of a consumer idle this long are reclaimed
    socket_timeout_s: float = 5.0
    retries: int = 5
    # redis: how long learner and generators wait out an unreachable server (with backoff) before failing
    outage_tolerance_s: float = 60.0


class CoordinatorConfig(_Section):
    """The learner's control endpoint: prompt tickets, weight versions, status."""

    address: str = "tcp://127.0.0.1:5556"
    timeout_s: float = 10.0
    generator_lease_s: float = 60.0  # a silent generator's tickets are reissued after this
    ticket_timeout_s: float = 600.0  # a ticket whose group never arrived is reissued after this
    # A generator's request for work waits up to this long at the learner when no work can be
    # admitted yet, and is answered the moment a new version or free slots appear (0: ask and sleep).
    long_poll_s: float = 1.0
    # Serve published weights over ZeroMQ here (generators without a shared file system);
    # unset: generators read learner.weights_dir directly.
    weights_address: str | None = None
    # With weights_address: send a generator only what changed since the version it holds
    # (a lossless, compressed bit-level difference) instead of the whole model.
    weight_deltas: bool = True
    curve_secret_file: str | None = None


class PrometheusConfig(_Section):
    """Prometheus /metrics endpoints (prometheus-client); each is off until its port is set."""

    learner_port: int | None = None  # learner rank 0
    generator_port: int | None = None  # the first generator; asyncrl run and --replicas count up from it
    host: str = "127.0.0.1"  # anything but loopback requires secret_file
    secret_file: str | None = None  # password for HTTP basic auth (user asyncrl); never put it in the config


class PushConfig(_Section):
    """Weight push from learner rank 0 straight into the generators' engines over a process group.

    NCCL between GPUs, gloo on CPU; no folders are written. Unset ``address``:
    versions travel as folders (``learner.weights_dir`` or ``coordinator.weights_address``).
    """

    address: str | None = None  # HOST:PORT of the rendezvous store learner rank 0 hosts
    generators: int = 1  # receiving engines; generator.push_rank numbers them 1..generators
    bucket_mb: int = 256  # MiB per broadcast (two buckets in flight on the sender)
    # the limit on each wait of a push (forming the group, the manifest, each bucket), not on the whole;
    # a wait that runs out abandons the push and generators keep the old version
    timeout_s: float = 60.0
    background: bool = True  # learner rank 0 broadcasts from a thread, from a gathered copy, while training goes on
    # a shared secret keying the rendezvous: the learner and generators refuse to start with an address and
    # none (the store listens on every interface); `asyncrl run` writes one for a loopback address
    secret_file: str | None = None


class VllmConfig(_Section):
    """The vLLM engine of a generator; unset values are decided by the hardware (GPU or CPU).

    ``engine_args`` passes anything else to ``vllm.LLM`` as is (for example
    ``{"kv_cache_dtype": "fp8"}``).
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: model.dtype
    enforce_eager: bool | None = None  # None: CUDA graphs on a GPU, eager on CPU
    gpu_memory_utilization: float | None = None  # None: vLLM's 0.9; lower it when a learner shares the GPU
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, sized by gpu_memory_utilization on a GPU
    max_model_len: int | None = None  # None: the model's own
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    # GRPO's samples of a prompt share it; cache keys carry the weight version. None: on with a GPU.
    enable_prefix_caching: bool | None = None
    engine_args: dict[str, Any] = {}


class GeneratorConfig(_Section):
    """One generator process."""

    backend: Literal["auto", "transformers", "vllm"] = "auto"
    replicas: int = 1
    samples_per_prompt: int = 8
    groups_per_request: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0  # only 1: the learner's log-probs are of the whole distribution
    stop: list[str] = []
    # None: `asyncrl run` shares the machine's cores evenly among the processes it starts (under
    # --ray: ray.generator_cpus); a generator started on its own uses torch's default (every core).
    torch_threads: int | None = None
    weight_load_timeout_s: float = 60.0
    # Apply new weights while requests are in flight (vLLM: between engine steps, tokens
    # stamped per version) rather than only between batches.
    update_in_flight: bool = True
    update_poll_s: float = 0.25  # how often a generator in mid-batch asks for new weights
    devices: str | int | None = None  # asyncrl run: GPUs for the generators, one each in turn ("1,2")
    vllm: VllmConfig = msgspec.field(default_factory=VllmConfig)
    push_rank: int = 1  # this engine's rank in the weight push group (push.address); replicas count up from it
    learner_patience_s: float = 300.0  # how long to wait for a learner that stopped answering (restarts)
    seed: int = 0


class LearnerConfig(_Section):
    """The learner group: optimisation and the DeepSpeed engine."""

    groups_per_step: int = 8
    total_steps: int = 100
    max_train_s: float = 0.0  # > 0: also finish once this many seconds have passed since the first batch
    publish_every_steps: int = 1
    # Write each version's folder on a thread while the next step trains, from the CPU copy every publish
    # takes; false: the step waits for the write. The push transport has push.background for the same.
    background_publish: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
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
    logprob_chunk_tokens: int = 1024
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
    # None: 3 with several ranks; 0 for one rank, where ZeRO has nothing to shard and its
    # partitioning hooks cost a fifth of a small model's step on CPU and half of it on one GPU.
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
    # generator.devices name the same single GPU (the one-GPU mode); false: folders.
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


class RayConfig(_Section):
    """Placement and supervision on a Ray cluster (``asyncrl run --ray``).

    Ray places and restarts the processes; rollouts and weights still travel
    through the buffer and the weight transport, never through Ray.
    """

    max_restarts: int = 3  # a generator actor that dies is restarted by Ray this many times (-1: always)
    generator_cpus: float = 1.0  # per generator actor (also its torch threads, where generator.torch_threads is unset)
    # per generator actor; None: generator.vllm.tensor_parallel_size on a cluster with GPUs, else 0
    generator_gpus: float | None = None
    learner_cpus: float = 1.0  # per learner rank (one bundle of the learner's placement group)
    learner_gpus: float | None = None  # per learner rank; None: 1 on a cluster with GPUs, else 0
    start_timeout_s: float = 300.0  # the learner's placement group must be placed within this
    drain_timeout_s: float = 60.0  # a generator removed by `asyncrl scale` finishes its batch within this
    # The local instance `asyncrl run --ray` starts without an address: its logical CPUs. None: four
    # per core (at least what the starting actors need), so that `asyncrl scale` can add generators;
    # every actor's torch threads still follow its ray.*_cpus.
    local_cpus: int | None = None


TOKEN_REWARD_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")  # returns built token by token


class AlgoConfig(_Section):
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
