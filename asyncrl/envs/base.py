"""The environment interface: what a user implements to train a model on multi-turn episodes.

One environment object serves one episode (one trajectory). It is made from
the dataset item, ``MyEnv(item, **task.env_args)``; :meth:`Environment.reset`
gives the first messages and the tools offered, and :meth:`Environment.step`
takes each model turn and answers with the next messages (tool results, a
user's reply), and once the episode is over, ``done`` and the reward::

    class GuessEnv:
        def __init__(self, item, tries=3):
            self.secret, self.tries = int(item["label"]), tries

        def reset(self):
            return Observation([{"role": "user", "content": "Guess my number (1-100)."}])

        def step(self, turn):
            guess = int(turn.text.strip() or 0)
            self.tries -= 1
            if guess == self.secret or not self.tries:
                return Feedback(reward=float(guess == self.secret), done=True)
            hint = "higher" if guess < self.secret else "lower"
            return Feedback([{"role": "user", "content": hint}])

Either method may be ``async def`` (an environment that waits on a server,
a container, a judge): it runs on the generator's environment loop; a plain
method runs in a thread. Either way the engine goes on sampling the other
episodes meanwhile. ``done`` without a reward scores the last turn's text with
the task's reward (``task.reward``), as single-turn tasks are scored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.envs.tools import BadCall, ToolCall

Message = dict[str, Any]  # {"role": ..., "content": ...}, as chat templates take it


@dataclass
class Observation:
    """An episode's start: the first messages, and the tools the model may call (plain functions)."""

    messages: list[Message]
    tools: Sequence[Callable[..., Any]] = ()


@dataclass(frozen=True)
class Turn:
    """One model turn: its text, the tool calls read from it, and why it ended."""

    text: str
    tool_calls: list[ToolCall | BadCall]
    finish_reason: str  # "stop": the model ended its turn; "length": its tokens ran out
    index: int  # 0 for the first turn


@dataclass
class Feedback:
    """What the environment answers a turn with.

    ``messages`` (tool results as ``{"role": "tool", ...}``, user turns)
    come next in the conversation; with ``done`` the episode ends, scored by
    ``reward`` (or, left None, by the task's reward on the last turn's text).
    ``metrics`` are numbers the learner averages per step (``env/<name>``).
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's counterpart; see the module doc. Either method may be a coroutine function."""

    def reset(self) -> Observation | Awaitable[Observation]: ...

    def step(self, turn: Turn) -> Feedback | Awaitable[Feedback]: ...


EnvFactory = Callable[[dict[str, Any]], Environment]  # the dataset item in, one episode's environment out
