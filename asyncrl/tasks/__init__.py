"""Tasks: where prompts come from, how each becomes token ids, and how responses are scored.

:func:`open_task` is what the learner and the generators call; both get the
same items in the same order, so a ticket's prompt index means the same
prompt everywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncrl.config import TaskConfig

log = logging.getLogger(__name__)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a process asyncrl starts with ``python -m``, which would put the working directory
    first on its import path: a user's folder named ``generators/``, ``learners/`` or ``buffers/`` would shadow
    asyncrl's own. It goes last instead; a user's module there is still found (:func:`import_user_module`)."""
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def import_user_module(name: str):
    """Import ``name``, looking in the working directory last when the import path has no such module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name.split(".")[0] or os.getcwd() in sys.path:
            raise
    sys.path.append(os.getcwd())
    return importlib.import_module(name)


def resolve(reference: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:callable``; errors name the config field."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: expected 'module:callable', got {reference!r}")
    try:
        target = getattr(import_user_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import {reference!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"{field}: {reference!r} is not callable")
    return target


def load_prompts(prompts: str, prompt_args: dict[str, Any]) -> list[dict[str, Any]]:
    """Call the configured prompt source and check what it returns."""
    items = resolve(prompts, "task.prompts")(**prompt_args)
    if not items or not all(isinstance(i, dict) and isinstance(i.get("prompt"), str) for i in items):
        raise ValueError(f"task.prompts: {prompts} must return a non-empty list of dicts with a 'prompt' string")
    return items


@dataclass
class Task:
    """A run's prompts (training and held-out), its prompt builder and its reward."""

    items: list[dict[str, Any]]
    eval_items: list[dict[str, Any]]
    prompt_ids: Callable[[dict[str, Any]], list[int]]
    reward: Callable[[str, dict[str, Any]], float]
    skipped: Counter[str] = field(default_factory=Counter)


def prompt_text(item: dict[str, Any]) -> str:
    """An item's prompt as text, for traces and reward servers: the prompt, or the last user message of a
    conversation."""
    prompt = item["prompt"]
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


def prompt_builder(task: TaskConfig, tokenizer) -> Callable[[dict[str, Any]], list[int]]:
    """Token ids of an item's prompt: the system prompt, then the prompt, through the chat template if asked.

    A prompt that is a conversation (a list of ``{"role", "content"}`` messages, as TRL's and verl's
    datasets hold them) always goes through the chat template; ``task.system_prompt`` is put first where it
    has no system message of its own.
    """
    def build(item: dict[str, Any]) -> list[int]:
        conversation = not isinstance(item["prompt"], str)
        if task.apply_chat_template or conversation:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("task.apply_chat_template: the model's tokenizer has no chat template"
                                 + (f" (row {item.get('row', '-')} is a conversation)" if conversation else ""))
            messages = list(item["prompt"]) if conversation else [{"role": "user", "content": item["prompt"]}]
            if task.system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": task.system_prompt})
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # noqa: BLE001  (the model's own Jinja template raised: say which setting)
                hint = (" (some templates take no system message: leave task.system_prompt unset, or set "
                        "task.apply_chat_template false)" if task.system_prompt else "")
                raise ValueError(f"task.apply_chat_template: the model's chat template failed on row "
                                 f"{item.get('row', '-')}: {type(exc).__name__}: {exc}{hint}") from exc
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        text = f"{task.system_prompt}\n\n{item['prompt']}" if task.system_prompt else item["prompt"]
        try:
            return tokenizer(text).input_ids
        except Exception as exc:  # noqa: BLE001  (the tokenizer library's own error: say what it means here)
            raise ValueError(f"model.path: the model's tokenizer cannot encode the prompt of row "
                             f"{item.get('row', '-')} ({type(exc).__name__}: {exc}): is model.path the model meant "
                             "for this data? (the quickstart's tiny model knows only digits)") from exc

    return build


def reward_function(task: TaskConfig) -> Callable[[str, dict[str, Any]], float]:
    """``task.rewards`` (a weighted sum) if set, else ``task.reward``: a built-in name, ``module:callable``,
    or the http(s):// URL of a reward model (:mod:`asyncrl.tasks.remote_reward`)."""
    from asyncrl.tasks.remote_reward import RemoteReward, is_remote
    from asyncrl.tasks.rewards import REWARDS, unknown_reward, weighted

    if task.rewards:
        _no_urls_in(task.rewards)
        return weighted(dict(task.rewards))
    reward = _reward_name(task)
    if is_remote(reward):
        r = task.remote_reward
        return RemoteReward(reward, timeout_s=r.timeout_s, deadline_s=task.reward_timeout_s, retries=r.retries,
                            backoff_s=r.backoff_s, max_backoff_s=r.max_backoff_s, max_in_flight=r.max_in_flight,
                            max_samples_per_request=r.max_samples_per_request, token_file=r.token_file)
    if reward in REWARDS:
        return REWARDS[reward]
    if ":" not in reward:
        raise unknown_reward("task.reward", reward, url=True)
    return resolve(reward, "task.reward")


def _reward_name(task: TaskConfig) -> str:
    """``task.reward`` (or the digit prompts' own), else the error that names the key and the built-in rewards."""
    reward = task.reward_name()
    if reward is None:
        raise ValueError(task.reward_error())
    return reward


def _no_urls_in(rewards: dict[str, float]) -> None:
    from asyncrl.tasks.remote_reward import is_remote

    remote = [name for name in rewards if is_remote(name)]
    if remote:
        raise ValueError(f"task.rewards: {remote[0]} is a reward model URL; give it as task.reward "
                         "(a reward model's score is not summed with others here)")


def load_items(task: TaskConfig, tokenizer) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Counter[str]]:
    """The task's training and held-out items, and the rows skipped, without building its reward.

    The learner needs only this (how many prompts there are, what was
    skipped); ``tokenizer`` is used to measure prompts for
    ``task.max_prompt_tokens`` and may be None without it.
    """
    if task.dataset:
        from asyncrl.tasks.data import load_task_data

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
            log.warning("task.prompts: skipped %d prompts longer than task.max_prompt_tokens (%d)",
                        skipped["prompt_too_long"], task.max_prompt_tokens)
        if not fitting:
            raise ValueError(f"task.prompts: all {len(items)} prompts are longer than task.max_prompt_tokens "
                             f"({task.max_prompt_tokens})")
        items = fitting
    return items, [], skipped


def check_task(task: TaskConfig, model_dir: str | None = None) -> None:
    """What a run needs of its task, checked in a moment before any process starts, so that a mistake is one
    line naming its key, not a process's traceback: the reward and the prompts hook resolve, and the dataset
    (and held-out set) open with usable rows among their first hundred. With ``model_dir`` (a local model
    folder), the first usable row's prompt is built as generators build it: a chat template that refuses it,
    or a tokenizer that cannot encode it, fails here, not in every generator."""
    from asyncrl.tasks.remote_reward import is_remote
    from asyncrl.tasks.rewards import REWARDS, unknown_reward

    field = "task.rewards" if task.rewards else "task.reward"
    if task.rewards:
        _no_urls_in(task.rewards)  # before locate(), which would find the standard library's http module
    for name in task.rewards or ([] if is_remote(_reward_name(task)) else [_reward_name(task)]):
        if ":" in name:
            locate(name, field)
        elif name not in REWARDS:
            raise unknown_reward(field, name, url=not task.rewards)
    if task.dataset:
        from asyncrl.tasks.data import check_rows

        first = check_rows(task.dataset, task, "task.dataset")
        if task.eval_dataset:
            check_rows(task.eval_dataset, task, "task.eval_dataset")
        if model_dir is not None:
            from transformers import AutoTokenizer

            prompt_builder(task, AutoTokenizer.from_pretrained(model_dir))(first)
    else:
        locate(task.prompts, "task.prompts")


def locate(reference: str, field: str) -> None:
    """``reference`` names a module that exists, and for asyncrl's own modules a callable in it, without
    importing a user's module (which may load a model as it is imported) into the launcher."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr or module_name.split(".")[0] == "asyncrl":
        resolve(reference, field)
        return
    # The run's processes look in the working directory last (import_user_module).
    sys.path.append(os.getcwd())
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        found = False
    finally:
        sys.path.pop()
    if not found:
        raise ValueError(f"{field}: cannot import {reference!r}: no module named {module_name!r} in the working "
                         "directory or on PYTHONPATH")


def open_task(task: TaskConfig, tokenizer) -> Task:
    """Load the task's prompts (dataset or hook) and build its prompt builder and reward (generators)."""
    items, eval_items, skipped = load_items(task, tokenizer)
    return Task(items, eval_items, prompt_builder(task, tokenizer), reward_function(task), skipped)
