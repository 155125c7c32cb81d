"""A tiny tool-use environment the quickstart's model learns on two CPU cores: ask for a hint, then copy it.

The prompt says nothing about the answer: the only way to it is the ``hint``
tool, whose result is the digit string to repeat. The final turn is scored
with the digit reward (the share of digits in place), and only if the hint was
asked for: a guess earns nothing, so the model first learns to call the tool,
then to copy what it said.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.envs.base import Feedback, Turn
from asyncrl.envs.tool_env import MethodsAsTools
from asyncrl.tasks.digits import digit_reward


def hint_prompts(num_prompts: int = 1000, length: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """``num_prompts`` items whose answer is a random digit string only the hint tool tells."""
    rng = random.Random(seed)
    return [
        {"prompt": "?", "answer": "".join(rng.choice("0123456789") for _ in range(length))} for _ in range(num_prompts)
    ]


class Hint:
    """The tool's side, written as a TRL-style environment class: its public method is the tool."""

    def reset(self, answer: str, **_: Any) -> None:
        self.answer, self.asked = answer, False

    def hint(self) -> str:
        """Tell the hidden answer.

        Returns:
            The digit string to repeat.
        """
        self.asked = True
        return self.answer


class HintEnv(MethodsAsTools):
    """The ``hint`` environment: the item's prompt, the one tool, the digit reward once the hint was asked for."""

    def __init__(self, item: dict[str, Any], **options: Any) -> None:
        super().__init__(Hint, item, **options)

    async def step(self, turn: Turn) -> Feedback:
        feedback = await super().step(turn)
        if feedback.done:
            feedback.reward = digit_reward(turn.text, self.item) if self.instance.asked else 0.0
        return feedback
