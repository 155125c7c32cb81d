"""The Countdown reward (TinyZero's task): reach a target with each of the item's numbers once.

Expressions are checked with ``ast`` and evaluated on exact fractions, with
no ``**`` and no names, so no answer can hang a generator.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 256
# A target claimed after "=": an integer, thousands separators allowed (1,000).
_CLAIMED = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A line that holds only an arithmetic expression, optionally followed by "= N".
_EXPRESSION_LINE = re.compile(r"[\d\s+\-*/().]*\d[\d\s+\-*/().]*(?:=\s*-?\d+)?")
_OPERATORS = {
    ast.Add: Fraction.__add__,
    ast.Sub: Fraction.__sub__,
    ast.Mult: Fraction.__mul__,
    ast.Div: Fraction.__truediv__,
}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.Constant, *_OPERATORS)


def extract_expression(response: str) -> str | None:
    """The response's final Countdown expression, or None.

    The content of the last ``<answer>...</answer>`` if there is one (even
    when it is not an expression, so that ``<answer>__import__('os')</answer>``
    is judged, and fails); else the last line that holds nothing but digits,
    ``+ - * / ( )`` and spaces, optionally ending in ``= N`` and wrapped in
    ``$...$``: ``"(25 - 5) * 3 = 60"``.
    """
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return " ".join(tags[-1].split())
    for line in reversed(response.splitlines()):
        line = line.strip().strip("$").strip().rstrip(".").strip()
        if _EXPRESSION_LINE.fullmatch(line) and re.search(r"[+\-*/]", line):
            return line
    return None


def evaluate_countdown(expression: str, numbers: list[int]) -> Fraction | None:
    """The exact value of ``expression`` if it uses each of ``numbers`` exactly once, else None.

    Exactly once is TinyZero's convention: ``"(25 - 5) * 3"`` is valid for
    ``[3, 5, 25]`` but not for ``[3, 5, 25, 7]`` (7 unused) nor ``"25 - 5 * 5"``
    (5 used twice). Only integer literals, ``+ - * /``, unary minus and
    parentheses are accepted: ``**`` (whose results can be astronomically
    large), ``//``, names and calls (``__import__('os')``) are refused by
    walking the ``ast`` before anything is evaluated, and the numbers are
    checked before evaluation too, so at most a handful of exact fraction
    operations run. Division by zero gives None.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    negated = {
        id(n.operand) for n in ast.walk(tree) if isinstance(n, ast.UnaryOp) and isinstance(n.operand, ast.Constant)
    }
    left = Counter(numbers)
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            return None
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                return None
            # -3 is the number -3 where the item has it, else 3 negated (TinyZero reads only the digits)
            value = -node.value if id(node) in negated and left[-node.value] > 0 else node.value
            if left[value] == 0:
                return None
            left[value] -= 1
    if +left:  # a number left unused
        return None
    try:
        return _evaluate(tree.body)
    except ZeroDivisionError:
        return None


def _evaluate(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    assert isinstance(node, ast.BinOp)  # evaluate_countdown admitted nothing else
    return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def countdown_reward(response: str, item: dict[str, Any]) -> float:
    """1.0 if the response's final expression reaches the target with the item's numbers, else 0.0.

    ``item`` has ``numbers`` (list of int) and ``target`` (int; ``label``
    holds the same as a string). The expression comes from
    ``extract_expression`` and is checked by ``evaluate_countdown``; a
    trailing ``= N`` must state the target too. For numbers ``[3, 5, 25]``
    and target 60: ``"<answer>(25 - 5) * 3</answer>"`` scores 1;
    ``"<answer>25 * 3 - 5</answer>"`` (70), ``"<answer>(25 - 5) * 3 * 3</answer>"``
    (3 reused) and ``"<answer>5 ** 3</answer>"`` score 0.
    """
    expression = extract_expression(response)
    if expression is None:
        return 0.0
    target = Fraction(str(item.get("target", item.get("label"))).strip())
    left, equals, claimed = expression.partition("=")
    claimed = claimed.strip()
    # thousands separators (1,000), which Fraction does not read
    if equals and (not _CLAIMED.fullmatch(claimed) or Fraction(claimed.replace(",", "")) != target):
        return 0.0
    value = evaluate_countdown(left, _countdown_numbers(item))
    return 1.0 if value is not None and value == target else 0.0


def _countdown_numbers(item: dict[str, Any]) -> list[int]:
    """The item's numbers (``numbers``, or TinyZero's ``nums``), refused by name unless a list of integers: a
    text column of "[3, 5, 25]" would otherwise be read character by character, and every answer score 0."""
    numbers = item.get("numbers", item.get("nums"))
    if not isinstance(numbers, (list, tuple)) or not all(
        hasattr(n, "__index__") or (isinstance(n, float) and n.is_integer())
        for n in numbers  # numpy's too
    ):
        raise ValueError(f"countdown: the item's numbers (or nums) must be a list of integers, not {numbers!r}")
    return [int(n) for n in numbers]
