"""Built-in tasks: prompt sources and reward functions named in configs."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def resolve(reference: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:callable``; errors name the config field."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: expected 'module:callable', got {reference!r}")
    try:
        target = getattr(importlib.import_module(module_name), attr)
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
