"""Tools: plain Python functions offered to the model, its calls parsed from its turn, run with a time limit.

A tool is what TRL, transformers' chat templates and the Qwen / Llama /
SmolLM tool formats expect: a function with type hints and a Google-style
docstring, whose JSON schema ``transformers.utils.get_json_schema`` makes.
Sync tools run in a daemon thread (one that hangs is abandoned at its time
limit, never waited for at exit), async ones on the environment loop.

Calls are read in the Hermes / Qwen form the model writes::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Whatever goes wrong with a call becomes an error message to the model in
its next turn, counted by kind (:data:`ERROR_KINDS`), never an exception in
the generator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Why a call gave the model an error instead of a result.
ERROR_KINDS = ("malformed_call", "unknown_tool", "bad_arguments", "tool_exception", "tool_timeout")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Strings may hold raw newlines (code a model writes): json's strict mode would refuse them.
_JSON = json.JSONDecoder(strict=False)
_SPACE = re.compile(r"\s*")
# JSON schema types and the Python values that satisfy them (bool is an int to Python, not to JSON).
JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: a tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    """A call that could not be read (``malformed_call``): what the model wrote, and why it is not a call."""

    text: str
    reason: str


@dataclass(frozen=True)
class ToolResult:
    """What a call gave the model: the tool's output, or an error of one of :data:`ERROR_KINDS`."""

    name: str
    content: str
    error: str | None = None  # the kind, for metrics; None when the tool answered
    took_s: float = 0.0


def parse_tool_calls(text: str) -> list[ToolCall | BadCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``, in order; one left open (a turn cut short) is bad.

    A call ends where its JSON does, so a ``</tool_call>`` inside a string
    argument (code that prints it) does not cut it short; a ``<tool_call>``
    that no JSON follows (prose naming the tag) is no call.
    """
    calls: list[ToolCall | BadCall] = []
    at = text.find(OPEN)
    while at >= 0:
        start = _SPACE.match(text, at + len(OPEN)).end()
        try:
            data, end = _JSON.raw_decode(text, start)
            end = _SPACE.match(text, end).end()
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            data, end = None, -1
        if end >= 0 and text.startswith(CLOSE, end):
            calls.append(_read_call(text[start:end].strip(), data))
            at = text.find(OPEN, end + len(CLOSE))
            continue
        close, following = text.find(CLOSE, start), text.find(OPEN, start)
        if close >= 0 and (following < 0 or close < following):  # closed, but not one JSON value: say why
            calls.append(_read_call(text[start:close].strip()))
            at = text.find(OPEN, close + len(CLOSE))
            continue
        if text.startswith("{", start):  # a call cut short (the turn ended, or the next call began)
            cut = text[at:following] if following >= 0 else text[at:]
            calls.append(BadCall(cut, "the <tool_call> is never closed with </tool_call>"))
        at = following  # else prose naming the tag: no call
    return calls


def _read_call(body: str, data: Any = None) -> ToolCall | BadCall:
    try:
        data = _JSON.decode(body) if data is None else data
    except json.JSONDecodeError as exc:
        return BadCall(body, f"not valid JSON ({exc.msg} at character {exc.pos})")
    except RecursionError:
        return BadCall(body, "not valid JSON (nested too deep)")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return BadCall(body, 'expected {"name": "<tool>", "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _JSON.decode(arguments)
        except (ValueError, RecursionError):
            return BadCall(body, "arguments is a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return BadCall(body, f"arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(data["name"], arguments)


_SCHEMAS: dict[Any, dict[str, Any]] = {}  # by function: a method's is the same for every instance


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The function's JSON schema as chat templates take it (``{"type": "function", "function": {...}}``)."""
    key = getattr(fn, "__func__", fn)
    try:
        hash(key)
    except TypeError:  # an unhashable callable: made each time
        return _make_schema(fn)
    if key not in _SCHEMAS:
        _SCHEMAS[key] = _make_schema(fn)
    return _SCHEMAS[key]


def _make_schema(fn: Callable) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers raises its own error types for a missing docstring or hint
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(
            f"tool {name!r} needs type hints on every argument and a Google-style docstring with an Args: "
            f"section describing each, as transformers' get_json_schema reads them: {exc}"
        ) from exc


class Toolbox:
    """The tools one episode may call, by name, each call limited to ``timeout_s`` seconds."""

    def __init__(self, tools: Sequence[Callable], timeout_s: float = 10.0) -> None:
        self.tools = {tool.__name__: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"two tools share a name: {[tool.__name__ for tool in tools]}")
        self.schemas = [tool_schema(tool) for tool in tools]
        self._parameters = {s["function"]["name"]: s["function"].get("parameters", {}) for s in self.schemas}
        self.timeout_s = timeout_s

    async def call(self, call: ToolCall | BadCall) -> ToolResult:
        """Run one call; every failure is a :class:`ToolResult` with an error, never an exception."""
        if isinstance(call, BadCall):
            return ToolResult("", f"Error: malformed tool call: {call.reason}.", "malformed_call")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                call.name, f"Error: there is no tool named {call.name!r} (tools: {known}).", "unknown_tool"
            )
        problem = self._check_arguments(call)
        if problem is not None:
            return ToolResult(call.name, f"Error: bad arguments for {call.name}: {problem}.", "bad_arguments")
        started = time.monotonic()
        try:
            output = await asyncio.wait_for(_invoke(tool, call.arguments), self.timeout_s)
        except TimeoutError:
            message = f"Error: {call.name} did not finish within {self.timeout_s:g} s."
            return ToolResult(call.name, message, "tool_timeout", time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001  (the model reads what went wrong; the episode goes on)
            message = f"Error: {call.name} raised {type(exc).__name__}: {exc}"
            return ToolResult(call.name, message, "tool_exception", time.monotonic() - started)
        return ToolResult(call.name, as_text(output), None, time.monotonic() - started)

    def _check_arguments(self, call: ToolCall) -> str | None:
        """Why ``call.arguments`` do not fit the tool's signature and schema, or None."""
        try:
            inspect.signature(self.tools[call.name]).bind(**call.arguments)
        except TypeError as exc:
            return str(exc)
        properties = self._parameters[call.name].get("properties", {})
        for name, value in call.arguments.items():
            wanted = properties.get(name, {}).get("type")
            kinds = wanted if isinstance(wanted, list) else [wanted] if wanted else []
            if kinds and properties[name].get("nullable"):  # an optional argument (x: int | None = None)
                kinds = [*kinds, "null"]
            if kinds and not any(JSON_TYPES.get(kind, lambda _: True)(value) for kind in kinds):
                return f"{name} must be of type {' or '.join(kinds)}, got {json.dumps(value)}"
        return None


def as_text(output: Any) -> str:
    """A tool's return value as the tool message's content."""
    if isinstance(output, str):
        return output
    try:
        return json.dumps(output)
    except (TypeError, ValueError):
        return str(output)


async def _invoke(tool: Callable, arguments: dict[str, Any]) -> Any:
    try:
        if inspect.iscoroutinefunction(tool):
            return await tool(**arguments)
        return await in_daemon_thread(tool, **arguments)
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:  # SystemExit (argparse on arguments it refuses) would end the environment loop
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc


class DaemonPool:
    """Daemon threads that run calls one after another, more started while none is free.

    Daemons, unlike a ThreadPoolExecutor's threads, which the interpreter
    joins at exit: a call that never returns is abandoned at its time limit
    and cannot keep the process from exiting. It holds its thread; the others
    go on serving.
    """

    def __init__(self, name: str = "tool") -> None:
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._idle == 0:
                self._started += 1
                threading.Thread(target=self._serve, name=f"{self.name}-{self._started}", daemon=True).start()
            else:
                self._idle -= 1
        self._calls.put((fn, args, kwargs, future))
        return future

    def _serve(self) -> None:
        while True:
            fn, args, kwargs, future = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001  (handed to whoever awaits the call)
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1


_POOL = DaemonPool()


def in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
    """``fn(*args, **kwargs)`` in a daemon thread (:class:`DaemonPool`), as a future of the running loop."""
    return asyncio.wrap_future(_POOL.submit(fn, *args, **kwargs))
