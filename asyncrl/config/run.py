"""The run config: every section of a run in one Struct, and the invariants that span processes."""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

# Imported at run time, not under TYPE_CHECKING: msgspec resolves RunConfig's annotations (strings, under
# `from __future__ import annotations`) from this module's globals.
from asyncrl.config import deployment as dep
from asyncrl.config.learning import TOKEN_REWARD_ESTIMATORS, AlgoConfig, LearnerConfig, step_checks
from asyncrl.config.sections import (
    EpisodeConfig,
    EvalConfig,
    GeneratorConfig,
    ModelConfig,
    Section,
    StalenessConfig,
    TaskConfig,
)
from asyncrl.tasks.rewards import missing_reward


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


GAE_IS_SINGLE_TURN = (
    "gae is for single-turn tasks: its critic would value an episode's tool results as the model's tokens "
    "(use grpo, dr_grpo, rloo or reinforce_pp with task.env or task.tools)"
)


class RunConfig(Section):
    """Everything a run needs; shared by every process of the run."""

    name: str = "run"
    run_dir: str = "runs/default"
    trace: bool = False  # write a timeline of every process to RUN_DIR/trace.json (open it in Perfetto)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    buffer: dep.BufferConfig = msgspec.field(default_factory=dep.BufferConfig)
    coordinator: dep.CoordinatorConfig = msgspec.field(default_factory=dep.CoordinatorConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    push: dep.PushConfig = msgspec.field(default_factory=dep.PushConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    prometheus: dep.PrometheusConfig = msgspec.field(default_factory=dep.PrometheusConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    episode: EpisodeConfig = msgspec.field(default_factory=EpisodeConfig)
    ray: dep.RayConfig = msgspec.field(default_factory=dep.RayConfig)
    mps: dep.MpsConfig = msgspec.field(default_factory=dep.MpsConfig)

    def _devices_as_text(self) -> None:
        """``devices: 0`` (a YAML or command-line number) means the GPU list "0"."""
        for section in (self.generator, self.learner):
            if isinstance(section.devices, int):
                section.devices = str(section.devices)

    def _generators_on_learner_devices(self) -> bool:
        """Whether ``generator.devices`` names exactly ``learner.devices`` (both set)."""
        return (
            self.learner.devices is not None
            and self.generator.devices is not None
            and self.generator.devices.strip() == self.learner.devices.strip()
        )

    def shares_weights(self) -> bool:
        """Whether versions travel in shared memory (``learner.shared_weights``; unset: one learner rank and
        the generators on the same single GPU, training the whole model: an adapter is small enough for a
        folder, which every backend loads)."""
        if self.learner.shared_weights is not None:
            return self.learner.shared_weights
        return (
            not self.learner.lora.enabled
            and self._generators_on_learner_devices()
            and self.learner.devices.strip().isdigit()
            and self.learner.ranks == 1
            and self.generator.vllm.tensor_parallel_size == 1
            and not self.push.address
            and not self.coordinator.weights_address
        )

    def __post_init__(self) -> None:
        self._devices_as_text()
        checks = [
            *self._generator_checks(),
            *self._algo_checks(),
            *self._learner_checks(),
            *step_checks(self.learner),
            *self._services_checks(),
            *dep.placement_checks(self.ray, self.generator.devices, self.generator.vllm.tensor_parallel_size),
            *self._eval_checks(),
            *self._weights_checks(),
        ]
        checks += self._task_checks()
        # Every wait has a timeout: none may be 0 or negative (ZeroMQ reads a negative poll as "forever").
        checks += [(value > 0, key, "must be > 0") for key, value in _timeouts(self)]
        for ok, key, why in checks:
            if not ok:
                raise ValueError(f"{why} - at `$.{key}`")

    def _algo_checks(self) -> list[tuple[bool, str, str]]:
        """The algorithm: staleness handling, losses, KL and advantages, and what each needs of the sampling."""
        return [
            (self.staleness.max_staleness >= 0, "staleness.max_staleness", "must be >= 0"),
            (
                self.generator.samples_per_prompt >= 2 or self.algo.advantage in ("reinforce_pp", "gae"),
                "generator.samples_per_prompt",
                f"must be >= 2 with algo.advantage {self.algo.advantage}, whose "
                "baseline is the group's other samples (one sample alone gets advantage 0: nothing is learned)",
            ),
            (self.algo.kl_coef >= 0, "algo.kl_coef", "must be >= 0"),
            (
                self.staleness.on_exceed == "drop" or self.algo.off_policy != "none",
                "staleness.on_exceed",
                "correct needs an off-policy correction: set algo.off_policy (tis, decoupled, icepop, seq_mask)",
            ),
            (self.algo.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0"),
            (self.algo.kl_in == "loss" or self.algo.kl_coef > 0, "algo.kl_in", "reward needs algo.kl_coef > 0"),
            (
                not (self.algo.kl_coef > 0 and self.algo.kl_in == "loss" and self.algo.kl_estimator == "k1"),
                "algo.kl_estimator",
                "k1 in the loss has a gradient of 0 in expectation, so it would not hold the policy "
                "near the reference: use k3 (or k2), or put k1 in the reward (algo.kl_in: reward)",
            ),
            (
                not self.algo.dynamic_sampling or self.generator.samples_per_prompt >= 2,
                "algo.dynamic_sampling",
                "needs generator.samples_per_prompt >= 2: a group of one always has a single reward, and would "
                "always be dropped",
            ),
            (0 <= self.algo.gamma <= 1 and 0 <= self.algo.lam <= 1, "algo.gamma", "gamma and lam must be in [0, 1]"),
            (
                self.algo.reward_scaling is None or self.algo.advantage not in TOKEN_REWARD_ESTIMATORS,
                "algo.reward_scaling",
                "applies to the group estimators (grpo, dr_grpo, rloo) only",
            ),
            (
                0 <= self.algo.clip_eps < 1 and (self.algo.clip_eps_high or 0) >= 0,
                "algo.clip_eps",
                "clip_eps must be in [0, 1) and clip_eps_high >= 0",
            ),
            (
                self.algo.dual_clip is None
                or self.algo.dual_clip
                > 1 + (self.algo.clip_eps if self.algo.clip_eps_high is None else self.algo.clip_eps_high),
                "algo.dual_clip",
                "must exceed 1 + the high clip epsilon",
            ),
            (self.algo.is_cap > 0, "algo.is_cap", "must be > 0"),
            (0 <= self.algo.mask_low <= self.algo.mask_high, "algo.mask_low", "need 0 <= mask_low <= mask_high"),
            (
                0 <= self.algo.overlong_buffer < self.generator.max_new_tokens,
                "algo.overlong_buffer",
                "must be >= 0 and below generator.max_new_tokens",
            ),
            (self.algo.dynamic_sampling_max_rounds >= 0, "algo.dynamic_sampling_max_rounds", "must be >= 0"),
            (
                self.algo.value_clip is None or self.algo.value_clip > 0,
                "algo.value_clip",
                "must be > 0, or null for no clip",
            ),
        ]

    def _generator_checks(self) -> list[tuple[bool, str, str]]:
        """Sampling and the generator pool."""
        return [
            (self.generator.samples_per_prompt >= 1, "generator.samples_per_prompt", "must be >= 1"),
            (self.generator.replicas >= 1, "generator.replicas", "must be >= 1"),
            (self.generator.max_new_tokens >= 1, "generator.max_new_tokens", "must be >= 1"),
            (self.generator.temperature > 0, "generator.temperature", "must be > 0"),
            (
                self.generator.top_p == 1.0,
                "generator.top_p",
                "must be 1: the learner scores each token under the "
                "whole distribution (log_softmax(logits / temperature)), and samples drawn from a nucleus would put "
                "every importance ratio off (0.54 on average at top_p 0.5, at the first on-policy step); sharpen "
                "sampling with generator.temperature instead",
            ),
            (
                self.generator.vllm.gpu_memory_utilization is None
                or 0 < self.generator.vllm.gpu_memory_utilization <= 1,
                "generator.vllm.gpu_memory_utilization",
                "must be in (0, 1]",
            ),
            (self.generator.vllm.tensor_parallel_size >= 1, "generator.vllm.tensor_parallel_size", "must be >= 1"),
            (self.generator.groups_per_request >= 1, "generator.groups_per_request", "must be >= 1"),
            ((self.generator.max_groups_in_flight or 1) >= 1, "generator.max_groups_in_flight", "must be >= 1 or null"),
        ]

    def _learner_checks(self) -> list[tuple[bool, str, str]]:
        """The learner: steps, budgets, checkpoints and restarts."""
        return [
            (self.learner.groups_per_step >= 1, "learner.groups_per_step", "must be >= 1"),
            (self.learner.publish_every_steps >= 1, "learner.publish_every_steps", "must be >= 1"),
            (self.learner.total_steps >= 1, "learner.total_steps", "must be >= 1"),
            (self.learner.max_train_s >= 0, "learner.max_train_s", "must be >= 0 (0: no time budget)"),
            (self.learner.stop_window_steps >= 1, "learner.stop_window_steps", "must be >= 1"),
            (0 <= self.eval.max_share < 1, "eval.max_share", "must be in [0, 1) (0: no budget)"),
            (self.learner.ranks >= 1, "learner.ranks", "must be >= 1"),
            (self.learner.checkpoint_every_steps >= 0, "learner.checkpoint_every_steps", "must be >= 0"),
            (self.learner.restarts >= 0, "learner.restarts", "must be >= 0"),
            (
                self.learner.restarts == 0 or self.learner.checkpoint_every_steps > 0,
                "learner.restarts",
                "needs learner.checkpoint_every_steps > 0: a learner restarted without a checkpoint starts over "
                "at version 0, behind the generators",
            ),
            (self.learner.keep_versions >= 1, "learner.keep_versions", "must be >= 1 (the version generators load)"),
            (self.learner.keep_checkpoints >= 1, "learner.keep_checkpoints", "must be >= 1"),
            (self.learner.lr > 0, "learner.lr", "must be > 0"),
        ]

    def _services_checks(self) -> list[tuple[bool, str, str]]:
        """The buffer and the coordinator: addresses, capacity, and what a Redis buffer needs."""
        return [
            (
                0 <= self.coordinator.long_poll_s < self.coordinator.timeout_s,
                "coordinator.long_poll_s",
                "must be >= 0 and below coordinator.timeout_s (the generator's wait for any answer)",
            ),
            (self.buffer.capacity >= 1, "buffer.capacity", "must be >= 1"),
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
                self.buffer.type != "redis" or not urlsplit(self.buffer.redis_url).password,
                "buffer.redis_url",
                "holds a password, which the run folder's config.yaml would show: put it in buffer.redis_password_file",
            ),
            (
                self.buffer.type != "redis" or not self.buffer.redis_open_beyond_loopback(),
                "buffer.redis_url",
                "reaches Redis beyond this machine without credentials: set buffer.redis_password_file (and "
                "buffer.redis_username for an ACL user), or anyone who reaches that Redis can write rollouts",
            ),
            (
                self.buffer.address != self.coordinator.address,
                "coordinator.address",
                "must differ from buffer.address",
            ),
        ]

    def _eval_checks(self) -> list[tuple[bool, str, str]]:
        """Held-out prompts and evaluation."""
        return [
            (0 <= self.task.eval_fraction < 1, "task.eval_fraction", "must be in [0, 1)"),
            (
                self.task.eval_fraction == 0 or self.task.dataset is not None,
                "task.eval_fraction",
                "splits task.dataset; the task.prompts hook has no held-out split",
            ),
            (
                self.eval.every_steps == 0 or bool(self.task.eval_dataset or self.task.eval_fraction),
                "eval.every_steps",
                "needs held-out prompts: set task.eval_dataset or task.eval_fraction",
            ),
            (
                self.eval.k >= 2,
                "eval.k",
                "must be >= 2: pass@1 is always the greedy answer's, and eval.k sampled answers give pass@k beside it",
            ),
            (self.eval.items_per_request >= 1, "eval.items_per_request", "must be >= 1"),
            (
                self.task.max_prompt_tokens is None or self.task.max_prompt_tokens >= 1,
                "task.max_prompt_tokens",
                "must be >= 1",
            ),
            (self.task.unscored_steps_to_fail >= 0, "task.unscored_steps_to_fail", "must be >= 0"),
        ]

    def _weights_checks(self) -> list[tuple[bool, str, str]]:
        """How weights travel: shared on one GPU, served, or pushed over NCCL."""
        tp = max(self.generator.vllm.tensor_parallel_size, 1)
        return [
            (
                self.coordinator.weights_address not in (self.buffer.address, self.coordinator.address),
                "coordinator.weights_address",
                "must differ from buffer.address and coordinator.address",
            ),
            (
                not self.learner.shared_weights or not (self.push.address or self.coordinator.weights_address),
                "learner.shared_weights",
                "hands weights over on this machine; it cannot be combined with "
                "push.address or coordinator.weights_address",
            ),
            (
                not self.learner.shared_weights or self.generator.vllm.tensor_parallel_size == 1,
                "learner.shared_weights",
                "needs generator.vllm.tensor_parallel_size 1: each generator shares the learner's one GPU",
            ),
            (
                not self.learner.shared_weights
                or self.learner.devices is None
                or self.generator.devices is None
                or self._generators_on_learner_devices(),
                "learner.shared_weights",
                "needs the generators on the learner's GPU: set generator.devices to learner.devices",
            ),
            (self.push.generators >= 1, "push.generators", "must be >= 1"),
            (self.push.bucket_mb >= 1, "push.bucket_mb", "must be >= 1"),
            (
                self.push.address is None
                or (
                    (self.generator.push_rank - 1) % tp == 0
                    and 1 <= self.generator.push_rank <= self.push.generators * tp
                ),
                "generator.push_rank",
                f"must be 1 + a multiple of generator.vllm.tensor_parallel_size ({tp}) in "
                f"1..{self.push.generators * tp} (push.generators {self.push.generators}, each engine's {tp} workers "
                "one rank each)",
            ),
        ]

    def _task_checks(self) -> list[tuple[bool, str, str]]:
        task, gen = self.task, self.generator
        model_len = gen.vllm.max_model_len if gen.backend != "transformers" else None
        no_reward = missing_reward(task)
        multi_turn = bool(task.env or task.tools)
        return [
            (no_reward is None, "task.reward", no_reward or ""),
            (self.episode.max_turns >= 1, "episode.max_turns", "must be >= 1"),
            (not multi_turn or self.algo.advantage != "gae", "algo.advantage", GAE_IS_SINGLE_TURN),
            (
                not task.eval_dataset or (task.eval_dataset, task.eval_split) != (task.dataset, task.split),
                "task.eval_split",
                f"held-out prompts would be the training prompts: task.eval_dataset and task.split "
                f"name the same source and split as task.dataset ({task.split!r}); set task.eval_split to another "
                "split (test, validation) or use task.eval_fraction",
            ),
            (
                model_len is None or task.max_prompt_tokens is None or task.max_prompt_tokens < model_len,
                "task.max_prompt_tokens",
                f"must be below generator.vllm.max_model_len ({model_len}): the engine "
                "refuses a prompt that fills the model's length",
            ),
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

    def replica_overrides(self, i: int) -> list[str]:
        """Replica ``i``'s ``--key=value`` settings: first push rank (one per engine worker), metrics port + ``i``."""
        port = self.prometheus.generator_port
        ranks = self.generator.vllm.tensor_parallel_size
        return [
            f"--generator.push_rank={self.generator.push_rank + i * ranks}",
            *([] if port is None else [f"--prometheus.generator_port={port + i}"]),
        ]
