"""The built-in tool-use environment, and the adapter that runs TRL-style environment classes.

:class:`ToolEnvironment` is what ``task.tools`` alone gives: the item's
prompt is the user's message; a turn with tool calls gets one ``tool``
message per call; the first turn without one ends the episode, scored by the
task's reward on its text.

:class:`MethodsAsTools` runs an environment written for TRL's
``environment_factory``: a class made without arguments, whose ``reset(**row)``
returns None or text to append to the prompt, whose public methods are its
tools and whose optional ``get_reward()`` scores the episode.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.envs.base import Feedback, Message, Observation, Turn
from asyncrl.envs.tools import Toolbox, ToolResult, in_daemon_thread


def prompt_messages(
    item: dict[str, Any], system_prompt: str | None = None, examples: Sequence[Message] = ()
) -> list[Message]:
    """The item's prompt as messages: a conversation as it is, a string as the user's message; ``examples`` (a
    worked conversation) go first, after the system prompt."""
    prompt = item["prompt"]
    messages = list(prompt) if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    at = 1 if messages[0]["role"] == "system" else 0
    return [*messages[:at], *examples, *messages[at:]]


def check_examples(examples: Any, field: str) -> list[Message]:
    """A worked conversation to show before each prompt: a list of messages with a known role and text content."""
    if not isinstance(examples, list):
        raise ValueError(f"{field}: a list of messages, got {type(examples).__name__}")
    for i, message in enumerate(examples):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "tool"):
            raise ValueError(f"{field}[{i}]: a message whose role is user, assistant or tool, got {message!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{field}[{i}].content: text, got {message.get('content')!r}")
    return examples


def tool_metrics(results: Sequence[ToolResult]) -> dict[str, float]:
    """Per-step numbers of a turn's calls: how many, how long they took, the errors by kind."""
    errors = Counter(r.error for r in results if r.error)
    return {
        "tool_calls": float(len(results)),
        "tool_s": sum(r.took_s for r in results),
        **{f"tool_errors/{kind}": float(n) for kind, n in errors.items()},
    }


def tool_messages(results: Sequence[ToolResult]) -> list[Message]:
    """One ``tool`` message per call, in the order the model made them."""
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


class ToolEnvironment:
    """The item's prompt, the configured tools, and the task's reward on the final answer; ``examples``, a worked
    conversation (a call, its result, an answer), go before every prompt."""

    def __init__(
        self,
        item: dict[str, Any],
        toolbox: Toolbox,
        system_prompt: str | None = None,
        examples: Sequence[Message] = (),
    ) -> None:
        self.item, self.toolbox, self.system_prompt, self.examples = item, toolbox, system_prompt, examples

    def reset(self) -> Observation:
        messages = prompt_messages(self.item, self.system_prompt, self.examples)
        return Observation(messages, list(self.toolbox.tools.values()))

    async def step(self, turn: Turn) -> Feedback:
        if not turn.tool_calls:
            return Feedback(done=True)
        results = [await self.toolbox.call(call) for call in turn.tool_calls]
        return Feedback(tool_messages(results), metrics=tool_metrics(results))


def is_methods_as_tools(env_class: Any) -> bool:
    """A TRL-style environment class: ``reset`` and no ``step``."""
    return callable(getattr(env_class, "reset", None)) and not callable(getattr(env_class, "step", None))


def public_methods(instance: Any) -> list[Callable]:
    """An instance's tools: its public methods, but ``reset`` and ``get_reward``, as TRL lists them."""
    names = [
        name
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]
    return [getattr(instance, name) for name in names]


class MethodsAsTools:
    """An environment written for TRL's ``environment_factory``, run episode by episode."""

    def __init__(
        self,
        env_class: Callable[[], Any],
        item: dict[str, Any],
        extra_tools: Sequence[Callable] = (),
        system_prompt: str | None = None,
        tool_timeout_s: float = 10.0,
        **env_args: Any,
    ) -> None:
        self.instance = env_class(**env_args)
        self.item, self.system_prompt = item, system_prompt
        self.tools = [*extra_tools, *public_methods(self.instance)]
        self.toolbox = Toolbox(self.tools, tool_timeout_s)

    async def reset(self) -> Observation:
        row = {k: v for k, v in self.item.items() if k != "row"}
        appended = await _call(self.instance.reset, **row)
        messages = prompt_messages(self.item, self.system_prompt)
        if appended:
            last = messages[-1]
            messages[-1] = {**last, "content": f"{last['content']}{appended}"}
        return Observation(messages, self.tools)

    async def step(self, turn: Turn) -> Feedback:
        if turn.tool_calls:
            results = [await self.toolbox.call(call) for call in turn.tool_calls]
            return Feedback(tool_messages(results), metrics=tool_metrics(results))
        get_reward = getattr(self.instance, "get_reward", None)
        reward = None if get_reward is None else float(await _call(get_reward))
        return Feedback(reward=reward, done=True)


async def _call(fn: Callable[..., Any], **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(**kwargs)
    result = await in_daemon_thread(fn, **kwargs)
    return await result if asyncio.iscoroutine(result) else result
