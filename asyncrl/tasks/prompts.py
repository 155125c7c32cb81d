"""Prompts: where they come from (a hook) and how one becomes token ids (the chat template, the system prompt)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.hooks import resolve

if TYPE_CHECKING:
    from asyncrl.config import TaskConfig


def load_prompts(prompts: str, prompt_args: dict[str, Any]) -> list[dict[str, Any]]:
    """Call the configured prompt source and check what it returns."""
    items = resolve(prompts, "task.prompts")(**prompt_args)
    if not items or not all(isinstance(i, dict) and isinstance(i.get("prompt"), str) for i in items):
        raise ValueError(f"task.prompts: {prompts} must return a non-empty list of dicts with a 'prompt' string")
    return items


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
                raise ValueError(
                    "task.apply_chat_template: the model's tokenizer has no chat template"
                    + (f" (row {item.get('row', '-')} is a conversation)" if conversation else "")
                )
            messages = list(item["prompt"]) if conversation else [{"role": "user", "content": item["prompt"]}]
            if task.system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": task.system_prompt})
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # noqa: BLE001  (the model's own Jinja template raised: say which setting)
                hint = (
                    " (some templates take no system message: leave task.system_prompt unset, or set "
                    "task.apply_chat_template false)"
                    if task.system_prompt
                    else ""
                )
                raise ValueError(
                    f"task.apply_chat_template: the model's chat template failed on row "
                    f"{item.get('row', '-')}: {type(exc).__name__}: {exc}{hint}"
                ) from exc
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        text = f"{task.system_prompt}\n\n{item['prompt']}" if task.system_prompt else item["prompt"]
        try:
            return tokenizer(text).input_ids
        except Exception as exc:  # noqa: BLE001  (the tokenizer library's own error: say what it means here)
            raise ValueError(
                f"model.path: the model's tokenizer cannot encode the prompt of row "
                f"{item.get('row', '-')} ({type(exc).__name__}: {exc}): is model.path the model meant "
                "for this data? (the quickstart's tiny model knows only digits)"
            ) from exc

    return build
