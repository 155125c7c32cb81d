"""Typed configuration: one section per process, one run config over them.

A run is described by one YAML file (``configs/*.yaml``). Every process reads
the same file and uses its own section: ``asyncrl-generator`` reads
``generator``, ``asyncrl-learner`` reads ``learner``, and both read the
shared ``model``, ``task``, ``buffer``, ``coordinator`` and ``staleness``
sections. :class:`RunConfig` checks the invariants that span processes.

Values are validated by msgspec; an error names the file and the dotted key.
Command-line overrides use the same dotted keys: ``--learner.lr 1e-5``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import io
import itertools
import json
import os
import re
import sys
import tokenize
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
import yaml


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

    def reward_error(self) -> str | None:
        """Why this task has no reward, naming the keys and the built-in rewards; None when it has one."""
        if self.rewards or self.reward_name() is not None:
            return None
        from asyncrl.tasks.rewards import REWARDS

        source = "task.dataset" if self.dataset else f"task.prompts ({self.prompts})"
        return (f"task.reward: not set, and {source} needs a reward: name a built-in one "
                f"({', '.join(sorted(REWARDS))}), a 'module:callable' or a reward model's http(s):// URL, "
                "or weigh several in task.rewards")


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


def positive_seconds(text: str) -> float:
    """An argparse type for a command-line duration: a number > 0 (argparse's error names the flag)."""
    import argparse

    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def finite_number(text: str) -> float:
    """An argparse type for a command-line number that must be finite (not nan, not inf)."""
    return _finite(text)


def _finite(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _timeouts(section: msgspec.Struct, prefix: str = "") -> list[tuple[str, float]]:
    """Every ``*timeout_s`` setting under ``section`` that is set, by its dotted key."""
    found = []
    for name in section.__struct_fields__:
        value = getattr(section, name)
        if isinstance(value, msgspec.Struct):
            found += _timeouts(value, f"{prefix}{name}.")
        elif name.endswith("timeout_s") and isinstance(value, (int, float)):
            found.append((f"{prefix}{name}", value))
    return found


def read_secret(push: PushConfig) -> str:
    """The shared secret in ``push.secret_file``; a push without one is refused (the store it rendezvouses
    on listens on every interface, whatever host ``push.address`` names)."""
    if not push.secret_file:
        raise ConfigError("push.secret_file is required with push.address: the rendezvous store listens on every "
                          "interface (`asyncrl run` writes one into the run folder; started by hand, give every "
                          "process the same file)")
    return read_secret_file(push.secret_file, "push.secret_file")


def read_secret_file(path: str, field: str) -> str:
    """The secret in the file ``field`` names; an unreadable or empty one is a :class:`ConfigError`."""
    try:
        secret = open(path).read().strip()
    except OSError as error:
        raise ConfigError(f"{field}: cannot read {path}: {error}") from error
    if not secret:
        raise ConfigError(f"{field}: {path} is empty; an empty secret keys nothing")
    return secret


def check_secrets(config: RunConfig, learner: bool = True, generator: bool = True) -> None:
    """The secrets the learner's and/or a generator's side will key with, read at start rather than at the first
    push or scrape."""
    if config.push.address:
        read_secret(config.push)
    prometheus = config.prometheus
    ports = [prometheus.learner_port if learner else None, prometheus.generator_port if generator else None]
    if prometheus.secret_file and any(port is not None for port in ports):
        read_secret_file(prometheus.secret_file, "prometheus.secret_file")


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
    top_p: float = 1.0
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
    # When the run stops early (an error, SIGTERM, --timeout-s), the learner checkpoints within this;
    # a ZeRO-3 checkpoint of a large model takes a while.
    stop_timeout_s: float = 120.0
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
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = \
        "token-mean"
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


class RunConfig(_Section):
    """Everything a run needs; shared by every process of the run."""

    name: str = "run"
    run_dir: str = "runs/default"
    trace: bool = False  # write a timeline of every process to RUN_DIR/trace.json (open it in Perfetto)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    coordinator: CoordinatorConfig = msgspec.field(default_factory=CoordinatorConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    push: PushConfig = msgspec.field(default_factory=PushConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    prometheus: PrometheusConfig = msgspec.field(default_factory=PrometheusConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)

    def _devices_as_text(self) -> None:
        """``devices: 0`` (a YAML or command-line number) means the GPU list "0"."""
        for section in (self.generator, self.learner):
            if isinstance(section.devices, int):
                section.devices = str(section.devices)

    def _generators_on_learner_devices(self) -> bool:
        """Whether ``generator.devices`` names exactly ``learner.devices`` (both set)."""
        return (self.learner.devices is not None and self.generator.devices is not None
                and self.generator.devices.strip() == self.learner.devices.strip())

    def shares_weights(self) -> bool:
        """Whether versions travel in shared memory (``learner.shared_weights``; unset: one learner rank and
        the generators on the same single GPU)."""
        if self.learner.shared_weights is not None:
            return self.learner.shared_weights
        return (self._generators_on_learner_devices() and self.learner.devices.strip().isdigit()
                and self.learner.ranks == 1 and self.generator.vllm.tensor_parallel_size == 1
                and not self.push.address and not self.coordinator.weights_address)

    def __post_init__(self) -> None:
        self._devices_as_text()
        checks = [
            (self.staleness.max_staleness >= 0, "staleness.max_staleness", "must be >= 0"),
            (self.generator.samples_per_prompt >= 1, "generator.samples_per_prompt", "must be >= 1"),
            (self.generator.samples_per_prompt >= 2 or self.algo.advantage in ("reinforce_pp", "gae"),
             "generator.samples_per_prompt", f"must be >= 2 with algo.advantage {self.algo.advantage}, whose "
             "baseline is the group's other samples (one sample alone gets advantage 0: nothing is learned)"),
            (self.generator.replicas >= 1, "generator.replicas", "must be >= 1"),
            (self.generator.max_new_tokens >= 1, "generator.max_new_tokens", "must be >= 1"),
            (self.generator.temperature > 0, "generator.temperature", "must be > 0"),
            (self.learner.groups_per_step >= 1, "learner.groups_per_step", "must be >= 1"),
            (self.learner.publish_every_steps >= 1, "learner.publish_every_steps", "must be >= 1"),
            (self.learner.total_steps >= 1, "learner.total_steps", "must be >= 1"),
            (self.generator.vllm.gpu_memory_utilization is None or 0 < self.generator.vllm.gpu_memory_utilization <= 1,
             "generator.vllm.gpu_memory_utilization", "must be in (0, 1]"),
            (self.generator.vllm.tensor_parallel_size >= 1, "generator.vllm.tensor_parallel_size", "must be >= 1"),
            (self.learner.max_train_s >= 0, "learner.max_train_s", "must be >= 0 (0: no time budget)"),
            (self.learner.ranks >= 1, "learner.ranks", "must be >= 1"),
            (0 <= self.coordinator.long_poll_s < self.coordinator.timeout_s, "coordinator.long_poll_s",
             "must be >= 0 and below coordinator.timeout_s (the generator's wait for any answer)"),
            (self.algo.kl_coef >= 0, "algo.kl_coef", "must be >= 0"),
            (self.staleness.on_exceed == "drop" or self.algo.off_policy != "none", "staleness.on_exceed",
             "correct needs an off-policy correction: set algo.off_policy (tis, decoupled, icepop, seq_mask)"),
            (self.algo.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0"),
            (self.algo.kl_in == "loss" or self.algo.kl_coef > 0, "algo.kl_in", "reward needs algo.kl_coef > 0"),
            (not (self.algo.kl_coef > 0 and self.algo.kl_in == "loss" and self.algo.kl_estimator == "k1"),
             "algo.kl_estimator", "k1 in the loss has a gradient of 0 in expectation, so it would not hold the policy "
             "near the reference: use k3 (or k2), or put k1 in the reward (algo.kl_in: reward)"),
            (not self.algo.dynamic_sampling or self.generator.samples_per_prompt >= 2, "algo.dynamic_sampling",
             "needs generator.samples_per_prompt >= 2: a group of one always has a single reward, and would "
             "always be dropped"),
            (0 <= self.algo.gamma <= 1 and 0 <= self.algo.lam <= 1, "algo.gamma", "gamma and lam must be in [0, 1]"),
            (self.algo.reward_scaling is None or self.algo.advantage not in TOKEN_REWARD_ESTIMATORS,
             "algo.reward_scaling", "applies to the group estimators (grpo, dr_grpo, rloo) only"),
            (0 <= self.algo.clip_eps < 1 and (self.algo.clip_eps_high or 0) >= 0, "algo.clip_eps",
             "clip_eps must be in [0, 1) and clip_eps_high >= 0"),
            (self.algo.dual_clip is None
             or self.algo.dual_clip > 1 + (self.algo.clip_eps if self.algo.clip_eps_high is None
                                           else self.algo.clip_eps_high),
             "algo.dual_clip", "must exceed 1 + the high clip epsilon"),
            (self.algo.is_cap > 0, "algo.is_cap", "must be > 0"),
            (0 <= self.algo.mask_low <= self.algo.mask_high, "algo.mask_low", "need 0 <= mask_low <= mask_high"),
            (0 <= self.algo.overlong_buffer < self.generator.max_new_tokens, "algo.overlong_buffer",
             "must be >= 0 and below generator.max_new_tokens"),
            (self.learner.checkpoint_every_steps >= 0, "learner.checkpoint_every_steps", "must be >= 0"),
            (self.learner.restarts >= 0, "learner.restarts", "must be >= 0"),
            (self.learner.restarts == 0 or self.learner.checkpoint_every_steps > 0, "learner.restarts",
             "needs learner.checkpoint_every_steps > 0: a learner restarted without a checkpoint starts over "
             "at version 0, behind the generators"),
            (self.ray.max_restarts >= -1, "ray.max_restarts", "must be >= 0, or -1 for no limit"),
            (self.ray.generator_cpus >= 0 and (self.ray.generator_gpus or 0) >= 0, "ray.generator_cpus",
             "ray.generator_cpus and ray.generator_gpus must be >= 0"),
            (self.ray.learner_cpus > 0 and (self.ray.learner_gpus or 0) >= 0, "ray.learner_cpus",
             "ray.learner_cpus must be > 0 (a placement group bundle cannot be empty), ray.learner_gpus >= 0"),
            (self.ray.local_cpus is None or self.ray.local_cpus >= 1, "ray.local_cpus", "must be >= 1"),
            (self.buffer.capacity >= 1, "buffer.capacity", "must be >= 1"),
            (0 <= self.task.eval_fraction < 1, "task.eval_fraction", "must be in [0, 1)"),
            (self.task.eval_fraction == 0 or self.task.dataset is not None, "task.eval_fraction",
             "splits task.dataset; the task.prompts hook has no held-out split"),
            (self.eval.every_steps == 0 or bool(self.task.eval_dataset or self.task.eval_fraction), "eval.every_steps",
             "needs held-out prompts: set task.eval_dataset or task.eval_fraction"),
            (self.eval.k >= 2, "eval.k", "must be >= 2: pass@1 is always the greedy answer's, and eval.k sampled "
             "answers give pass@k beside it"),
            (self.eval.items_per_request >= 1, "eval.items_per_request", "must be >= 1"),
            (self.task.max_prompt_tokens is None or self.task.max_prompt_tokens >= 1, "task.max_prompt_tokens",
             "must be >= 1"),
            (self.learner.keep_versions >= 1, "learner.keep_versions", "must be >= 1 (the version generators load)"),
            (self.learner.keep_checkpoints >= 1, "learner.keep_checkpoints", "must be >= 1"),
            (self.task.unscored_steps_to_fail >= 0, "task.unscored_steps_to_fail", "must be >= 0"),
            (self.algo.dynamic_sampling_max_rounds >= 0, "algo.dynamic_sampling_max_rounds", "must be >= 0"),
            (self.learner.lr > 0, "learner.lr", "must be > 0"),
            (self.algo.value_clip is None or self.algo.value_clip > 0, "algo.value_clip",
             "must be > 0, or null for no clip"),
            (
                self.buffer.type != "redis" or self.learner.checkpoint_every_steps > 0,
                "learner.checkpoint_every_steps",
                "must be > 0 with buffer.type redis (rollouts are acknowledged at checkpoints)",
            ),
            (
                self.buffer.type != "redis" or self.buffer.outage_tolerance_s < self.learner.batch_timeout_s,
                "buffer.outage_tolerance_s",
                f"must be below learner.batch_timeout_s ({self.learner.batch_timeout_s:g}) with buffer.type redis, "
                "or the learner gives up waiting for rollouts before the outage does",
            ),
            (
                self.buffer.address != self.coordinator.address,
                "coordinator.address",
                "must differ from buffer.address",
            ),
            (self.generator.groups_per_request >= 1, "generator.groups_per_request", "must be >= 1"),
            (
                self.coordinator.weights_address not in (self.buffer.address, self.coordinator.address),
                "coordinator.weights_address",
                "must differ from buffer.address and coordinator.address",
            ),
            (not self.learner.shared_weights or not (self.push.address or self.coordinator.weights_address),
             "learner.shared_weights", "hands weights over on this machine; it cannot be combined with "
             "push.address or coordinator.weights_address"),
            (not self.learner.shared_weights or self.generator.vllm.tensor_parallel_size == 1,
             "learner.shared_weights", "needs generator.vllm.tensor_parallel_size 1: each generator shares the "
             "learner's one GPU"),
            (not self.learner.shared_weights or self.learner.devices is None or self.generator.devices is None
             or self._generators_on_learner_devices(),
             "learner.shared_weights", "needs the generators on the learner's GPU: set generator.devices to "
             "learner.devices"),
            (self.push.generators >= 1, "push.generators", "must be >= 1"),
            (self.push.bucket_mb >= 1, "push.bucket_mb", "must be >= 1"),
            (
                self.push.address is None or 1 <= self.generator.push_rank <= self.push.generators,
                "generator.push_rank",
                f"must be in 1..push.generators ({self.push.generators})",
            ),
        ]
        checks += self._task_checks()
        # Every wait has a timeout: none may be 0 or negative (ZeroMQ reads a negative poll as "forever").
        checks += [(value > 0, key, "must be > 0") for key, value in _timeouts(self)]
        for ok, key, why in checks:
            if not ok:
                raise ValueError(f"{why} - at `$.{key}`")

    def _task_checks(self) -> list[tuple[bool, str, str]]:
        task, gen = self.task, self.generator
        model_len = gen.vllm.max_model_len if gen.backend != "transformers" else None
        no_reward = task.reward_error()
        return [
            (no_reward is None, "task.reward", no_reward or ""),
            (not task.eval_dataset or (task.eval_dataset, task.eval_split) != (task.dataset, task.split),
             "task.eval_split", f"held-out prompts would be the training prompts: task.eval_dataset and task.split "
             f"name the same source and split as task.dataset ({task.split!r}); set task.eval_split to another "
             "split (test, validation) or use task.eval_fraction"),
            (model_len is None or task.max_prompt_tokens is None or task.max_prompt_tokens < model_len,
             "task.max_prompt_tokens", f"must be below generator.vllm.max_model_len ({model_len}): the engine "
             "refuses a prompt that fills the model's length"),
        ]

    def prompt_task(self) -> TaskConfig:
        """``task`` as the learner and the generators read prompts: with ``generator.vllm.max_model_len`` set
        and ``task.max_prompt_tokens`` not, a prompt of ``max_model_len`` tokens or more, which every engine would
        refuse, is skipped alike by both (``prompt_too_long``, logged with its row). Derived, never written back:
        the run's config.yaml keeps what was given."""
        model_len = self.generator.vllm.max_model_len
        if model_len is None or self.generator.backend == "transformers" or self.task.max_prompt_tokens is not None:
            return self.task
        return msgspec.structs.replace(self.task, max_prompt_tokens=model_len - 1)

    @property
    def samples_per_step(self) -> int:
        return self.learner.groups_per_step * self.generator.samples_per_prompt

    @property
    def samples_per_version(self) -> int:
        return self.samples_per_step * self.learner.publish_every_steps


def _pairs(overrides: list[str]) -> list[tuple[str, str]]:
    """``(dotted key, value text)`` of ``key.sub=value`` / ``--key.sub value`` overrides."""
    pairs: list[tuple[str, str]] = []
    items = list(overrides)
    while items:
        item = items.pop(0)
        key = item[2:] if item.startswith("--") else item
        if "=" in key:
            key, value = key.split("=", 1)
        elif items and not items[0].startswith("--"):
            value = items.pop(0)
        else:
            raise ConfigError(f"override --{key} has no value (write --{key}=VALUE)")
        pairs.append((key, value))
    return pairs


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` / ``--key.sub value`` overrides to a raw config dict.

    Values are parsed as YAML scalars (``1e-5``, ``true``, ``[a, b]``), except
    for text settings, which take the value as written: ``"#### <number>"``
    would be a YAML comment, ``yes`` a boolean, ``0123`` a number (a value in
    YAML quotes is still read as YAML). ``null`` unsets a text setting that
    may be unset.
    """
    for key, value in _pairs(overrides):
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: `{part}` is not a section")
            node = child
        text = _text_key(key)
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""  # YAML's quotes, as ever
        if text is None or quoted:
            node[leaf] = yaml.safe_load(value)
        else:
            node[leaf] = None if text == "optional" and value in ("null", "~") else value
    return data


def _key_type(parts: Sequence[str]) -> Any:
    """The type of the setting (or section) at dotted path ``parts`` of :class:`RunConfig`; None if none."""
    cls: Any = RunConfig
    for part in parts:
        cls = {f.name: f.type for f in msgspec.structs.fields(cls)}.get(part) if _is_struct(cls) else None
    return cls


def _text_key(key: str) -> str | None:
    """``"text"`` if ``key`` is a plain text setting, ``"optional"`` if text or null, None otherwise."""
    cls = _key_type(key.split("."))
    if cls is str:
        return "text"
    if get_origin(cls) in (Union, types.UnionType) and set(get_args(cls)) == {str, type(None)}:
        return "optional"
    return None


# Keys that were renamed or moved, and what they are now: an old config gets one line, not "unknown field".
RENAMED = {
    "learner.clip_eps": "`algo.clip_eps`",
    "learner.kl_coef": "`algo.kl_coef`",
    "learner.zero_bucket_mb": "`learner.zero_bucket_elements` (DeepSpeed counts its buckets in elements; "
                              "the old 500 meant 524288000 elements)",
}

# What TRL's GRPOConfig, verl and OpenRLHF call a setting, and the key here (then a note), for the "unknown key"
# error.
_PROMPTS_PER_STEP = "learner.groups_per_step (prompts per step; samples = groups x generator.samples_per_prompt)"
PEER_NAMES = {
    "learning_rate": "learner.lr", "actor_learning_rate": "learner.lr", "lr": "learner.lr",
    "num_generations": "generator.samples_per_prompt", "n_samples_per_prompt": "generator.samples_per_prompt",
    "rollout_n": "generator.samples_per_prompt",
    "batch_size": _PROMPTS_PER_STEP, "train_batch_size": _PROMPTS_PER_STEP,
    "per_device_train_batch_size": _PROMPTS_PER_STEP,
    "rollout_batch_size": "learner.groups_per_step (prompts per step)",
    "max_completion_length": "generator.max_new_tokens", "response_length": "generator.max_new_tokens",
    "max_response_length": "generator.max_new_tokens", "generate_max_len": "generator.max_new_tokens",
    "max_prompt_length": "task.max_prompt_tokens", "prompt_max_len": "task.max_prompt_tokens",
    "beta": "algo.kl_coef", "kl_loss_coef": "algo.kl_coef", "init_kl_coef": "algo.kl_coef",
    "epsilon": "algo.clip_eps", "clip_ratio": "algo.clip_eps", "eps_clip": "algo.clip_eps",
    "epsilon_high": "algo.clip_eps_high", "clip_ratio_high": "algo.clip_eps_high",
    "delta": "algo.dual_clip", "clip_ratio_c": "algo.dual_clip",
    "max_steps": "learner.total_steps", "total_training_steps": "learner.total_steps",
    "num_train_epochs": "learner.total_steps (steps, not epochs)",
    "max_grad_norm": "learner.grad_clip", "grad_clip": "learner.grad_clip",
    "gradient_checkpointing": "learner.gradient_checkpointing",
    "model_name_or_path": "model.path", "pretrain": "model.path",
    "vllm_gpu_memory_utilization": "generator.vllm.gpu_memory_utilization",
    "gpu_memory_utilization": "generator.vllm.gpu_memory_utilization",
    "entropy_coeff": "algo.entropy_coef", "loss_agg_mode": "algo.loss_agg", "loss_type": "algo.loss_agg",
    "adv_estimator": "algo.advantage", "advantage_estimator": "algo.advantage",
    "scale_rewards": "algo.reward_scaling",
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"`{key}` is given twice in one section",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply dotted overrides, and validate it.

    Raises :class:`ConfigError` naming the file (or the override) and the offending key.
    """
    source = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    if path:
        try:
            data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            inside = Path(path) / "config.yaml"
            hint = f" (this run folder's config is {inside})" if inside.exists() else ""
            raise ConfigError(f"{path} is a folder, not a config file{hint}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    if overrides:
        data = apply_overrides(data, overrides)
    for old, new in RENAMED.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(f"{source}: `{old}` is now {new}")
    try:
        return msgspec.convert(data, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explained(exc, source, overrides or [])) from None


def _explained(error: msgspec.ValidationError, source: str, overrides: list[str]) -> str:
    """A validation error that blames the override that set the key, if one did, and suggests the key meant
    where one is unknown."""
    text = str(error)
    where = re.search(r" - at `\$((?:\.\w+)*)`", text)
    unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
    parts = [p for p in (where.group(1).split(".") if where else []) if p]
    key = ".".join(parts + ([unknown.group(1)] if unknown else []))
    set_by = [k for k, _ in _pairs(overrides)
              if key and (k == key or key.startswith(k + ".") or k.startswith(key + "."))]
    blamed = f"override --{set_by[-1]}" if set_by else source
    cls = _key_type(parts)
    if unknown:
        known = [f.name for f in msgspec.structs.fields(cls)] if _is_struct(cls) else []
        close = difflib.get_close_matches(unknown.group(1), known, n=1)
        section = ".".join(parts)
        if unknown.group(1) in PEER_NAMES:
            meant, _, note = PEER_NAMES[unknown.group(1)].partition(" ")
            hint = f"; that setting is `{meant}` here{' ' + note if note else ''}"
        else:
            hint = f"; did you mean `{section + '.' if section else ''}{close[0]}`?" if close else ""
        return f"{blamed}: unknown key `{key}`{hint}"
    if text.startswith("Invalid enum value") and get_origin(cls) is Literal:
        return f"{blamed}: {text} (expected one of {', '.join(map(str, get_args(cls)))})"
    return f"{blamed}: {text}"


def to_yaml(config: RunConfig) -> str:
    """The resolved config as YAML, as written next to a run's outputs."""
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)


def describe_keys(sections: Sequence[str] | None = None) -> str:
    """Every config key as ``dotted.name  type = default  comment``, grouped by section.

    Generated from the Struct types above, so a new field shows up in every
    CLI's ``--help`` without anyone writing it twice; comments are the
    field's ``#`` comments in this file. ``sections`` picks fields of
    :class:`RunConfig` by name (``"learner"``, ``"run_dir"``); None: all.
    """
    top = {f.name: f for f in msgspec.structs.fields(RunConfig)}
    chosen = list(top) if sections is None else list(sections)
    unknown = [name for name in chosen if name not in top]
    if unknown:
        raise ValueError(f"not fields of RunConfig: {unknown}")
    groups: list[tuple[str, list[tuple[str, str, str]]]] = []
    scalars = [top[n] for n in chosen if not _is_struct(top[n].type)]
    if scalars:
        groups.append(("top level", _rows(RunConfig, scalars, "")))
    for name in chosen:
        cls = top[name].type
        if _is_struct(cls):
            doc = (cls.__doc__ or "").strip()
            heading = f"{name}: {doc.splitlines()[0]}" if doc else name
            groups.append((heading, _rows(cls, msgspec.structs.fields(cls), f"{name}.")))
    rows = [row for _, group in groups for row in group if row[1]]
    key_w = max((len(key) for key, _, _ in rows), default=0)
    spec_w = min(max((len(spec) for _, spec, _ in rows), default=0), 30)  # a longer default pushes only its own comment
    lines = ["config keys: --KEY VALUE or KEY=VALUE, VALUE as YAML (from asyncrl/config.py)"]
    for heading, group in groups:
        lines += ["", heading]
        for key, spec, comment in group:
            if not spec:  # a comment over a group of fields
                lines.append(f"  # {comment}")
            else:
                lines.append(f"  {key:<{key_w}}  {spec:<{spec_w}}  {comment}".rstrip())
    return "\n".join(lines)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _rows(cls: type, fields: Iterable[Any], prefix: str) -> list[tuple[str, str, str]]:
    """``(key, "type = default", comment)`` per leaf field; ``spec`` is empty for a group comment line."""
    comments = _field_comments(cls)
    rows: list[tuple[str, str, str]] = []
    for f in fields:
        above, trailing = comments.get(f.name, ("", ""))
        if _is_struct(f.type):  # a nested section
            rows += _rows(f.type, msgspec.structs.fields(f.type), f"{prefix}{f.name}.")
            continue
        if above and trailing:
            rows.append(("", "", above))
        rows.append((prefix + f.name, f"{_type_name(f.type)} = {_default(f)}", trailing or above))
    return rows


def _type_name(tp: Any) -> str:
    """``float``, ``str | None``, ``zmq|inproc|redis`` (a Literal), ``dict[str, Any]``."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(f: Any) -> str:
    """The default as it would be written in YAML or on the command line."""
    if f.default is not msgspec.NODEFAULT:
        value = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, str) and value and yaml.safe_load(value) == value:
        return value
    if isinstance(value, float) and "e" in repr(value) and "." not in repr(value):
        mantissa, exponent = repr(value).split("e")
        return f"{mantissa}.0e{exponent}"  # YAML 1.1 reads 1e-05 as a string, 1.0e-05 as a float
    return json.dumps(msgspec.to_builtins(value))


def _field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (comment lines above it, comment after it)}`` read from the class's source."""
    return _module_comments(cls.__module__).get(cls.__qualname__, {})


@functools.cache
def _module_comments(module: str) -> dict[str, dict[str, tuple[str, str]]]:
    """Field comments of every top-level class of ``module``, from one pass of ``tokenize``.

    One pass over the module, because ``inspect.getsource(cls)`` parses the
    whole module again for every class (~30 ms each). Empty when the source
    is not available: the help then lists no comments.
    """
    try:
        source = inspect.getsource(sys.modules[module])
    except (KeyError, OSError, TypeError):
        return {}
    found: dict[str, dict[str, tuple[str, str]]] = {}
    fields: dict[str, tuple[str, str]] = {}
    depth, field, pending, line_start = 0, None, [], True
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for tok, nxt in itertools.pairwise(tokens):
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.line[: tok.start[1]].strip() and field is not None:
                above, trailing = fields[field]
                fields[field] = (above, f"{trailing} {text}".strip())
            else:
                pending.append(text)
        elif tok.type == tokenize.NL and not tok.line.strip():
            pending = []  # a blank line ends a comment block
        elif tok.type == tokenize.NEWLINE:
            field, pending = None, []
        elif line_start and depth == 0 and tok.string == "class" and nxt.type == tokenize.NAME:
            fields = found.setdefault(nxt.string, {})
        elif line_start and depth == 1 and tok.type == tokenize.NAME and nxt.string == ":":
            field = tok.string
            fields[field] = (" ".join(pending), "")
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            line_start = tok.type == tokenize.NEWLINE
    return found
