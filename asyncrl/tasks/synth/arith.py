"""GSM8K-style arithmetic: a start value and a chain of steps, told as a story or as a bare expression.

The answer is computed from the problem's numbers, never read back from text.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.synth.scenes import NAMES, SCENES

SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
APPLY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


@dataclass(frozen=True)
class ArithProblem:
    """A start value and a chain of ``(op, operand)`` steps, told in one scene."""

    scene: int  # index into SCENES
    name: str
    start: int
    steps: tuple[tuple[str, int], ...]  # op is "add", "sub" or "mul"
    phrasing: tuple[int, ...]  # which sentence: the start's, each step's, the question's

    def values(self) -> list[int]:
        """The value after the start and after each step."""
        values = [self.start]
        for op, operand in self.steps:
            values.append(APPLY[op](values[-1], operand))
        return values

    def row(self, style: str = "story") -> dict[str, Any]:
        """``question``, a GSM8K ``answer`` (worked lines, then ``#### N``) and ``label``.

        ``story`` tells the problem in its scene; ``bare`` asks for the
        expression alone ("What is (12 + 5) * 3?"), the same steps and answer.
        """
        if style == "bare":
            return self._bare_row()
        scene, values = SCENES[self.scene], self.values()
        pick = iter(self.phrasing)
        sentences = [scene.start[next(pick)].format(name=self.name, x=self.start)]
        lines = []
        for (op, operand), before, after in zip(self.steps, values, values[1:]):
            sentences.append(getattr(scene, op)[next(pick)].format(name=self.name, x=operand))
            work = f"{before} {SYMBOLS[op]} {operand} = <<{before}{SYMBOLS[op]}{operand}={after}>>{after}"
            lines.append(_capitalize(scene.state.format(name=self.name, x=work)) + ".")
        sentences.append(scene.question[next(pick)].format(name=self.name))
        label = str(values[-1])
        return {"question": " ".join(sentences), "answer": "\n".join(lines) + f"\n#### {label}", "label": label}

    def _bare_row(self) -> dict[str, Any]:
        values = self.values()
        expression, lines, last_op = str(self.start), [], None
        for (op, operand), before, after in zip(self.steps, values, values[1:]):
            if op == "mul" and last_op in ("add", "sub"):
                expression = f"({expression})"  # the steps apply in order
            expression = f"{expression} {SYMBOLS[op]} {operand}"
            lines.append(f"{before} {SYMBOLS[op]} {operand} = <<{before}{SYMBOLS[op]}{operand}={after}>>{after}")
            last_op = op
        label = str(values[-1])
        return {"question": f"What is {expression}?", "answer": "\n".join(lines) + f"\n#### {label}", "label": label}


def arith_problem(
    rng: random.Random,
    min_steps: int = 1,
    max_steps: int = 2,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("add", "sub", "mul"),
    allow_negative: bool = False,
) -> ArithProblem:
    """A random problem: every number (start and operands) has ``min_digits`` to ``max_digits`` digits.

    Every number is at least 2 (no "1 apples", no "1 times"). Unless
    ``allow_negative`` (and then only in a ``signed`` scene), a subtraction
    never takes a value below zero and nothing is multiplied while the value
    is zero; a draw that cannot go on under those rules is drawn again.
    """
    for _ in range(1000):
        scene_index = rng.randrange(len(SCENES))
        scene = SCENES[scene_index]
        if not set(ops) & {op for op in SYMBOLS if getattr(scene, op)}:
            continue
        signed = allow_negative and scene.signed
        phrasing = [rng.randrange(len(scene.start))]
        value = start = _number(rng, min_digits, max_digits)
        steps = []
        smallest = max(2, 10 ** (min_digits - 1))
        for _ in range(rng.randint(min_steps, max_steps)):
            allowed = [
                op
                for op in ops
                if getattr(scene, op)
                and (signed or not (op == "sub" and value < smallest or op == "mul" and value == 0))
            ]
            if not allowed:
                break
            op = rng.choice(allowed)
            most = value if op == "sub" and not signed else None
            operand = _number(rng, min_digits, max_digits, most=most)
            steps.append((op, operand))
            phrasing.append(rng.randrange(len(getattr(scene, op))))
            value = APPLY[op](value, operand)
        else:
            phrasing.append(rng.randrange(len(scene.question)))
            return ArithProblem(scene_index, rng.choice(NAMES), start, tuple(steps), tuple(phrasing))
    raise ValueError(
        f"no problem found with ops={list(ops)}, digits {min_digits}-{max_digits}, "
        f"steps {min_steps}-{max_steps}: allow more operations or digits"
    )


def _number(rng: random.Random, min_digits: int, max_digits: int, most: int | None = None) -> int:
    """A number of ``min_digits`` to ``max_digits`` digits (each count equally likely) in ``2..most``."""
    if most is not None:
        max_digits = min(max_digits, len(str(most)))
    digits = rng.randint(min_digits, max_digits)
    high = 10**digits - 1 if most is None else min(10**digits - 1, most)
    return rng.randint(max(2, 10 ** (digits - 1)), high)


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]
