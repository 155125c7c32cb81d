"""Digit-string tasks with a dense reward, for the quickstart and the tests.

A prompt is a string of digits followed by ``=``; the answer is the same
digits reversed, sorted, copied, or each one up by one (``next``: 9 becomes 0),
as ``mode`` says. The reward is the fraction of answer positions the response
gets right, so a policy earns partial credit from its first steps and the
learning curve is smooth.
"""

from __future__ import annotations

import random
from typing import Any

_ANSWERS = {
    "reverse": lambda digits: digits[::-1],
    "sort": lambda digits: "".join(sorted(digits)),
    "copy": lambda digits: digits,
    # no position agrees with ``copy``'s answer: two runs on these disagree at every digit
    "next": lambda digits: "".join(str((int(d) + 1) % 10) for d in digits),
}


def digit_prompts(num_prompts: int = 1000, length: int = 3, seed: int = 0, mode: str = "copy") -> list[dict[str, Any]]:
    """``num_prompts`` random digit strings of ``length`` digits, deterministic in ``seed``."""
    if mode not in _ANSWERS:
        raise ValueError(f"task.prompt_args.mode: expected one of {sorted(_ANSWERS)}, got {mode!r}")
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        items.append({"prompt": f"{digits}=", "answer": _ANSWERS[mode](digits)})
    return items


def digit_reward(response: str, item: dict[str, Any]) -> float:
    """Fraction of the answer's positions matched; extra or missing characters cost.

    The answer is the item's ``label`` when it came from a dataset (a GSM8K ``#### N`` answer's N), else
    its ``answer``.
    """
    answer = str(item["label"] if "label" in item else item["answer"])
    response = response.strip()
    hits = sum(a == b for a, b in zip(response, answer))
    return hits / max(len(answer), len(response), 1)
