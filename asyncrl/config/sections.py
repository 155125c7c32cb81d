"""The per-process sections of a run's config: one msgspec Struct per process or shared concern.

Each section checks its own fields' types; what spans sections is checked by
:class:`asyncrl.config.run.RunConfig`. A field's ``#`` comments are its
``--help`` text (:func:`asyncrl.config.describe.describe_keys` reads them from
the module that defines the section), so they are written for the user.

This module holds the base, the model, the task and the generator;
:mod:`~asyncrl.config.learning` the learner and the algorithm;
:mod:`~asyncrl.config.deployment` how the processes reach each other and
where they run (buffer, coordinator, weight push, Prometheus, Ray).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """An invalid configuration; the message names the file and the key."""


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The base of every config section: an unknown key is an error, and every field is set by name."""


class ModelConfig(Section):
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


class RemoteRewardConfig(Section):
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


class TaskConfig(Section):
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
    # multi-turn episodes: a built-in environment (tools, hint) or module:Class, made per episode from the
    # dataset item as Class(item, **env_args); unset with task.tools set: the built-in tools environment
    env: str | None = None
    env_args: dict[str, Any] = {}
    # tools offered to the model: built-in names (calculator, python) or module:function (type hints and a
    # Google-style docstring, as transformers' get_json_schema reads them)
    tools: list[str] = []

    def reward_name(self) -> str | None:
        """``reward``, else the digit reward for the built-in digit prompts; None where the user must name one
        (a dataset scored by the digit-copy reward would train on noise without a word)."""
        if self.reward is not None:
            return self.reward
        return DIGIT_REWARD if self.dataset is None and self.prompts == DIGIT_PROMPTS else None


class EpisodeConfig(Section):
    """Multi-turn episodes (``task.env`` or ``task.tools``): their limits and how tools reach the model."""

    max_turns: int = 4  # model turns per episode; one that reaches it is truncated
    # tokens per episode, prompt and every turn (unset: generator.vllm.max_model_len where set, else the prompt
    # plus max_turns * generator.max_new_tokens); an episode that reaches it is truncated
    max_tokens: int | None = None
    # a truncated episode: mask (its tokens teach nothing; its reward, truncated_reward, counts in its group's
    # baseline), penalty (trained with reward truncated_reward) or keep (trained, scored by task.reward)
    truncated: Literal["mask", "penalty", "keep"] = "mask"
    truncated_reward: float = 0.0
    tool_timeout_s: float = 10.0  # per tool call; a call that takes longer answers the model with an error
    step_timeout_s: float = 60.0  # per reset or step of an environment; one that takes longer drops its episode
    workers: int = 64  # environment calls running at once per generator (reset, step, sync tools)
    # template: the chat template's tools= section; system_prompt: the tools' schemas in the system prompt in the
    # Hermes form (for templates without a tools section); auto: template where it shows tools
    tool_format: Literal["auto", "template", "system_prompt"] = "auto"
    # text every episode's first turn starts with, written for the model (not trained on): "<tool_call>\n" has
    # it open a tool call first, as a required tool_choice does, for a model that would not call one by itself
    first_turn_prefix: str = ""


class EvalConfig(Section):
    """Held-out evaluation, run by the generators while training goes on (needs held-out prompts)."""

    every_steps: int = 0  # 0: off; else at the start, every this many steps, and at the end
    k: int = 4  # samples per prompt for pass@k (>= 2), besides the greedy one for pass@1
    temperature: float = 1.0  # of the k samples
    max_items: int | None = None  # the first this many held-out prompts; unset: all
    items_per_request: int = 16  # prompts per piece handed to one generator
    max_new_tokens: int | None = None  # unset: generator.max_new_tokens
    final_timeout_s: float = 600.0  # how long the learner waits for the final evaluation at the end
    # > 0: evaluation takes about this share of the tokens generated while training runs (a piece may
    # overdraw it by its own size). Pieces wait until training has earned them, and an evaluation not begun
    # when the next one falls due is skipped for it (the newest due version is evaluated). The starting
    # evaluation goes out in full at once and is charged (those after it wait until training has earned it
    # back, so a short run sees few); the final one, after training, is not. 0: every due evaluation in
    # full, at once.
    max_share: float = 0.0


class StalenessConfig(Section):
    """The hard per-sample bound; 0 is synchronous on-policy training."""

    max_staleness: int = 1
    # A sample found over the bound when its batch is formed: dropped, or kept and weighted by
    # the learner's off-policy correction (algo.off_policy, which must then not be none).
    on_exceed: Literal["drop", "correct"] = "drop"


class VllmConfig(Section):
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


class GeneratorConfig(Section):
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
    # how often a generator in mid-batch reports groups written to a durable buffer and prompts its engine
    # refused, and a multi-turn one asks for more tickets; new weights are heard of at the next engine step
    # through a request the learner holds until it publishes
    update_poll_s: float = 0.25
    # An engine that takes requests while others run (vLLM) is given more work as groups finish, up to this
    # many groups in flight; None: as many as the staleness bound admits on a GPU, groups_per_request on a CPU.
    max_groups_in_flight: int | None = None
    devices: str | int | None = None  # asyncrl run: GPUs for the generators, one each in turn ("1,2")
    vllm: VllmConfig = msgspec.field(default_factory=VllmConfig)
    push_rank: int = 1  # this engine's rank in the weight push group (push.address); replicas count up from it
    learner_patience_s: float = 300.0  # how long to wait for a learner that stopped answering (restarts)
    seed: int = 0
    # Python's garbage-collector thresholds (gc.set_threshold) in a process whose vLLM engine runs in it: a
    # decode step makes thousands of objects, and at Python's (700, 10, 10) the collector paused the engine
    # loop 0.17 s in every 3 s of generation on one H100 (bench/README.md). null keeps Python's.
    gc_thresholds: tuple[int, int, int] | None = (50_000, 10, 10)
