"""Multi-turn environments and tools: what a model talks to between its turns.

``task.env`` names an environment (a built-in name or ``module:Class``),
``task.tools`` the tools (built-in names or ``module:function``) and
``task.env_args`` the keyword arguments each environment is made with.
:func:`environment_factory` turns them into the one callable a generator
needs: a dataset item in, one episode's environment out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.envs.base import EnvFactory, Environment, Feedback, Message, Observation, Turn
from asyncrl.envs.tool_env import MethodsAsTools, ToolEnvironment, check_examples, is_methods_as_tools
from asyncrl.envs.tools import Toolbox, ToolCall, parse_tool_calls, tool_schema
from asyncrl.tasks.hooks import locate, resolve

if TYPE_CHECKING:
    from asyncrl.config import TaskConfig

__all__ = [
    "EnvFactory",
    "Environment",
    "Feedback",
    "Message",
    "Observation",
    "ToolCall",
    "Toolbox",
    "Turn",
    "check_environment",
    "environment_factory",
    "parse_tool_calls",
    "tool_schema",
]

TOOL_ENV = "tools"  # the built-in environment: the item's prompt, task.tools, the task's reward
ENVIRONMENTS = {TOOL_ENV: "asyncrl.envs.tool_env:ToolEnvironment", "hint": "asyncrl.envs.hint:HintEnv"}
TOOLS = {"calculator": "asyncrl.envs.calculator:calculator", "python": "asyncrl.envs.sandbox:python"}


def env_name(task: TaskConfig) -> str | None:
    """The episode environment a task runs, or None for single-turn prompts: ``task.env``, else the built-in
    tool environment where ``task.tools`` is set."""
    return task.env or (TOOL_ENV if task.tools else None)


def _reference(name: str, table: dict[str, str], field: str) -> str:
    if ":" in name:
        return name
    if name not in table:
        raise ValueError(f"{field}: unknown name {name!r}: expected one of {sorted(table)} or 'module:callable'")
    return table[name]


def resolve_tools(names: list[str]) -> list[Callable[..., Any]]:
    """The tools ``task.tools`` names, each checked for a schema the chat template can show."""
    tools = [resolve(_reference(name, TOOLS, "task.tools"), "task.tools") for name in names]
    for name, tool in zip(names, tools):
        try:
            tool_schema(tool)
        except ValueError as exc:
            raise ValueError(f"task.tools: {name}: {exc}") from exc
    return tools


def check_environment(task: TaskConfig) -> None:
    """Before any process starts: the environment and every tool can be found (a user's module is located,
    not imported)."""
    name = env_name(task)
    if name is None:
        return
    locate(_reference(name, ENVIRONMENTS, "task.env"), "task.env")
    for tool in task.tools:
        locate(_reference(tool, TOOLS, "task.tools"), "task.tools")
    if _reference(name, ENVIRONMENTS, "task.env") == ENVIRONMENTS[TOOL_ENV]:
        tool_env_examples(task)


def _check_sandbox(tools: list[Callable[..., Any]]) -> None:
    """The built-in ``python`` tool runs only in a sandbox: one that cannot start here fails the generator now,
    naming what to install, rather than every tool call of the run (which the model would read and train on)."""
    from asyncrl.envs import sandbox

    if any(tool is sandbox.python for tool in tools):
        try:
            sandbox.default_sandbox()
        except sandbox.SandboxError as exc:
            raise ValueError(f"task.tools: python: {exc}") from exc


def tool_env_examples(task: TaskConfig) -> list[Message]:
    """The built-in tools environment's one option, ``task.env_args.examples``; any other key is an error."""
    unknown = sorted(set(task.env_args) - {"examples"})
    if unknown:
        raise ValueError(f"task.env_args: the tools environment takes only 'examples', got {unknown}")
    return check_examples(task.env_args.get("examples", []), "task.env_args.examples")


def environment_factory(task: TaskConfig, tool_timeout_s: float) -> EnvFactory | None:
    """One episode's environment from a dataset item, as the task configures it; None for single-turn tasks.

    ``ToolEnvironment`` shares one toolbox; a TRL-style class (``reset`` and no
    ``step``) runs through :class:`MethodsAsTools` with ``task.tools`` beside
    its own methods; any other class is called as ``Class(item, **task.env_args)``.
    """
    name = env_name(task)
    if name is None:
        return None
    env_class = resolve(_reference(name, ENVIRONMENTS, "task.env"), "task.env")
    tools = resolve_tools(task.tools)
    _check_sandbox(tools)
    system_prompt, args = task.system_prompt, dict(task.env_args)
    if env_class is ToolEnvironment:
        toolbox, examples = Toolbox(tools, tool_timeout_s), tool_env_examples(task)
        return lambda item: ToolEnvironment(item, toolbox, system_prompt, examples)
    if is_methods_as_tools(env_class):
        return lambda item: MethodsAsTools(env_class, item, tools, system_prompt, tool_timeout_s, **args)
    if isinstance(env_class, type) and issubclass(env_class, MethodsAsTools):
        options = {"extra_tools": tools, "system_prompt": system_prompt, "tool_timeout_s": tool_timeout_s}
        return lambda item: env_class(item, **options, **args)
    return lambda item: env_class(item, **args)
