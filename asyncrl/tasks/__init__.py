"""Tasks: where prompts come from, how each becomes token ids, and how responses are scored.

:func:`open_task` is what the learner and the generators call; both get the
same items in the same order, so a ticket's prompt index means the same
prompt everywhere.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.data import check_rows, load_task_data
from asyncrl.tasks.hooks import child_env, import_user_module, locate, resolve
from asyncrl.tasks.prompts import load_prompts, prompt_builder, prompt_text
from asyncrl.tasks.remote_reward import RemoteReward, is_remote
from asyncrl.tasks.rewards import REWARDS, missing_reward, unknown_reward, weighted

if TYPE_CHECKING:
    from asyncrl.config import TaskConfig

__all__ = [
    "Task",
    "check_task",
    "child_env",
    "import_user_module",
    "load_items",
    "open_task",
    "prompt_builder",
    "prompt_text",
    "resolve",
    "reward_function",
]

log = logging.getLogger(__name__)


@dataclass
class Task:
    """A run's prompts (training and held-out), its prompt builder and its reward."""

    items: list[dict[str, Any]]
    eval_items: list[dict[str, Any]]
    prompt_ids: Callable[[dict[str, Any]], list[int]]
    reward: Callable[[str, dict[str, Any]], float]
    skipped: Counter[str] = field(default_factory=Counter)


def reward_function(task: TaskConfig) -> Callable[[str, dict[str, Any]], float]:
    """``task.rewards`` (a weighted sum) if set, else ``task.reward``: a built-in name, ``module:callable``,
    or the http(s):// URL of a reward model (:mod:`asyncrl.tasks.remote_reward`)."""

    if task.rewards:
        _no_urls_in(task.rewards)
        return weighted(dict(task.rewards))
    if task.env and task.reward_name() is None:
        return _environment_scores
    reward = _reward_name(task)
    if is_remote(reward):
        r = task.remote_reward
        return RemoteReward(
            reward,
            timeout_s=r.timeout_s,
            deadline_s=task.reward_timeout_s,
            retries=r.retries,
            backoff_s=r.backoff_s,
            max_backoff_s=r.max_backoff_s,
            max_in_flight=r.max_in_flight,
            max_samples_per_request=r.max_samples_per_request,
            token_file=r.token_file,
        )
    if reward in REWARDS:
        return REWARDS[reward]
    if ":" not in reward:
        raise unknown_reward("task.reward", reward, url=True)
    return resolve(reward, "task.reward")


def _environment_scores(response: str, item: dict[str, Any]) -> float:
    """The reward of a task whose environment scores its episodes, asked for an episode it left unscored."""
    raise ValueError(
        "the environment ended an episode without a reward (or it ran out of episode.max_turns or "
        "episode.max_tokens) and task.reward is not set to score it"
    )


def _reward_name(task: TaskConfig) -> str:
    """``task.reward`` (or the digit prompts' own), else the error that names the key and the built-in rewards."""
    reward = task.reward_name()
    if reward is None:
        raise ValueError(missing_reward(task))
    return reward


def _no_urls_in(rewards: dict[str, float]) -> None:

    remote = [name for name in rewards if is_remote(name)]
    if remote:
        raise ValueError(
            f"task.rewards: {remote[0]} is a reward model URL; give it as task.reward "
            "(a reward model's score is not summed with others here)"
        )


def load_items(task: TaskConfig, tokenizer) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Counter[str]]:
    """The task's training and held-out items, and the rows skipped, without building its reward.

    The learner needs only this (how many prompts there are, what was
    skipped); ``tokenizer`` is used to measure prompts for
    ``task.max_prompt_tokens`` and may be None without it.
    """
    if task.dataset:
        build = prompt_builder(task, tokenizer)
        data = load_task_data(task, lambda item: len(build(item)))
        return data.items, data.eval_items, data.skipped
    if task.eval_dataset:
        raise ValueError("task.eval_dataset needs task.dataset (the prompts hook has no held-out split)")
    items, skipped = load_prompts(task.prompts, task.prompt_args), Counter[str]()
    if task.max_prompt_tokens:  # measured as the generators measure it, so both keep the same prompts
        build = prompt_builder(task, tokenizer)
        fitting = [item for item in items if len(build(item)) <= task.max_prompt_tokens]
        if len(fitting) < len(items):
            skipped["prompt_too_long"] = len(items) - len(fitting)
            log.warning(
                "task.prompts: skipped %d prompts longer than task.max_prompt_tokens (%d)",
                skipped["prompt_too_long"],
                task.max_prompt_tokens,
            )
        if not fitting:
            raise ValueError(
                f"task.prompts: all {len(items)} prompts are longer than task.max_prompt_tokens "
                f"({task.max_prompt_tokens})"
            )
        items = fitting
    return items, [], skipped


def check_task(task: TaskConfig, model_dir: str | None = None) -> None:
    """What a run needs of its task, checked in a moment before any process starts, so that a mistake is one
    line naming its key, not a process's traceback: the reward and the prompts hook resolve, and the dataset
    (and held-out set) open with usable rows among their first hundred. With ``model_dir`` (a local model
    folder), the first usable row's prompt is built as generators build it: a chat template that refuses it,
    or a tokenizer that cannot encode it, fails here, not in every generator."""

    field = "task.rewards" if task.rewards else "task.reward"
    if task.rewards:
        _no_urls_in(task.rewards)  # before locate(), which would find the standard library's http module
    named = task.rewards or ([] if task.env and task.reward_name() is None else [_reward_name(task)])
    for name in [name for name in named if not is_remote(name)]:
        if ":" in name:
            locate(name, field)
        elif name not in REWARDS:
            raise unknown_reward(field, name, url=not task.rewards)
    if task.dataset:
        first = check_rows(task.dataset, task, "task.dataset")
        if task.eval_dataset:
            check_rows(task.eval_dataset, task, "task.eval_dataset")
        if model_dir is not None:
            from transformers import AutoTokenizer

            prompt_builder(task, AutoTokenizer.from_pretrained(model_dir))(first)
    else:
        locate(task.prompts, "task.prompts")


def open_task(task: TaskConfig, tokenizer) -> Task:
    """Load the task's prompts (dataset or hook) and build its prompt builder and reward (generators)."""
    items, eval_items, skipped = load_items(task, tokenizer)
    return Task(items, eval_items, prompt_builder(task, tokenizer), reward_function(task), skipped)
