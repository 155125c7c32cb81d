"""Countdown (as in TinyZero): reach a target with each of a few numbers once; solvable by construction."""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class CountdownProblem:
    """Numbers, a target, and one expression (``solution``) that uses each number once to reach it."""

    numbers: tuple[int, ...]
    target: int
    solution: str

    def row(self) -> dict[str, Any]:
        """``numbers``, ``target``, a TinyZero-style ``question``, ``label`` and ``solution``."""
        numbers = list(self.numbers)
        question = (
            f"Using the numbers {numbers}, create an equation that equals {self.target}. "
            "You can use basic arithmetic operations (+, -, *, /) and each number must be used exactly once. "
            "Show your work in <think> </think> tags. And return the final equation in <answer> </answer> "
            "tags, for example <answer> (1 + 2) / 3 </answer>."
        )
        return {
            "numbers": numbers,
            "target": self.target,
            "question": question,
            "label": str(self.target),
            "solution": self.solution,
        }


def countdown_problem(
    rng: random.Random, count: int = 3, min_number: int = 1, max_number: int = 99, max_target: int = 100
) -> CountdownProblem:
    """Solvable by construction: draw ``count`` numbers, combine them at random, keep the value as target.

    Pairs are combined in random order with a random operation; every
    intermediate value stays a non-negative integer (a subtraction that
    would go negative or a division that leaves a remainder picks another
    operation). Draws whose value is not in ``1..max_target`` are redrawn.
    """
    for _ in range(10_000):
        numbers = tuple(rng.randint(min_number, max_number) for _ in range(count))
        terms = [(str(n), Fraction(n)) for n in numbers]
        rng.shuffle(terms)
        while len(terms) > 1:
            (left, a), (right, b) = terms.pop(rng.randrange(len(terms))), terms.pop(rng.randrange(len(terms)))
            choices = ["+", "*"] + (["-"] if a >= b else []) + (["/"] if b and (a / b).denominator == 1 else [])
            op = rng.choice(choices)
            value = a + b if op == "+" else a * b if op == "*" else a - b if op == "-" else a / b
            terms.append((f"({left} {op} {right})", value))
        solution, value = terms[0]
        if 1 <= value <= max_target:
            return CountdownProblem(numbers, int(value), solution[1:-1])
    raise ValueError(f"no target in 1..{max_target} found from {count} numbers in {min_number}..{max_number}")
