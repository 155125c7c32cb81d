"""A calculator tool for models: arithmetic on numbers, evaluated by walking the syntax tree.

The expression is parsed with ``ast.parse(expr, mode="eval")`` and only
number literals, ``+ - * / // % **``, unary ``+``/``-``, parentheses and
calls of ``abs``, ``round``, ``min`` and ``max`` are evaluated; anything
else (names, attributes, subscripts, lambdas, comprehensions) is refused
before any arithmetic runs. Nothing reaches ``eval``, so a model's
``__import__('os')`` is only a syntax tree that names a function not on the
list.

Every cost is bounded before it is paid. The text is at most
``MAX_EXPRESSION_CHARS`` long and its tree at most ``MAX_NODES`` nodes. Every
literal and every intermediate result stays within ``MAX_MAGNITUDE``. A power
is checked before it is computed: its exponent is at most ``MAX_EXPONENT`` and
the result's size is estimated from logarithms. So ``9**9**9`` and
``2**10**10`` are refused in microseconds rather than computed for minutes.

Errors raise :class:`CalculatorError`, a ``ValueError``; the environment that
calls the tool turns its message into the tool's reply to the model.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
# Syntax-tree expression nodes (numbers, operations, calls); "1+2" has 3.
MAX_NODES = 100
# The largest absolute value of a literal or of any intermediate result.
MAX_MAGNITUDE = 10**18
# The largest absolute exponent of a power.
MAX_EXPONENT = 64
# round(x, n) accepts |n| up to this many digits.
MAX_ROUND_DIGITS = 18
# Significant digits of a float result that is not a whole number.
FLOAT_DIGITS = 10

Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Number, Number], Number]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = ("abs", "round", "min", "max")
_OPERATOR_SYMBOLS = {
    ast.MatMult: "@",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.Invert: "~",
    ast.Not: "not",
}
# What the refusal says of a node type the calculator does not evaluate.
_REFUSED = {
    ast.Subscript: "subscripts (indexing) are not allowed",
    ast.Slice: "slices are not allowed",
    ast.List: "lists are not allowed",
    ast.Tuple: "tuples are not allowed",
    ast.Set: "sets are not allowed",
    ast.Dict: "dicts are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "generator expressions are not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "the boolean operators and, or are not allowed",
    ast.IfExp: "conditional expressions (if/else) are not allowed",
    ast.NamedExpr: "assignments (:=) are not allowed",
    ast.JoinedStr: "f-strings are not allowed",
    ast.Starred: "starred arguments are not allowed",
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Supports integers and decimals, + - * / // % ** with the usual precedence, parentheses, and the functions
    abs, round, min and max. Integer results are exact; other results are rounded to 10 significant digits.
    Variables and any other Python are not accepted.

    Args:
        expression: The arithmetic expression to evaluate, for example "(128 * 36) / 12".

    Returns:
        The value of the expression as text, for example "384".
    """
    return format_number(evaluate(expression))


def evaluate(expression: str) -> Number:
    """The value of ``expression`` as an int or a float; :class:`CalculatorError` if it is refused.

    An int divided by an int that divides it stays an exact int (``12/4`` is
    ``3``), so integer arithmetic is never rounded through a float.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(
            f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS} are allowed"
        )
    if not expression.strip():
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: a null byte
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise CalculatorError(f"not a valid arithmetic expression: {reason}") from None
    _check_tree(tree)
    return _evaluate(tree.body)


def format_number(value: Number) -> str:
    """An int exactly; a whole float as an int (``3.0`` is ``"3"``); other floats to ``FLOAT_DIGITS`` digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 10**15:  # below 2**53: the int is the float exactly
        return str(int(value))
    return f"{value:.{FLOAT_DIGITS}g}"


def _check_tree(tree: ast.Expression) -> None:
    """Refuse, before evaluating anything, a tree that is too large or holds something not allowed."""
    nodes = [node for node in ast.walk(tree) if isinstance(node, ast.expr)]
    if len(nodes) > MAX_NODES:
        raise CalculatorError(f"the expression has {len(nodes)} parts; at most {MAX_NODES} are allowed")
    called = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
    for node in nodes:
        if isinstance(node, ast.Constant):
            _check_literal(node.value)
        elif isinstance(node, ast.BinOp | ast.UnaryOp):
            if type(node.op) not in _BINARY and type(node.op) not in _UNARY:
                raise CalculatorError(f"the operator {_OPERATOR_SYMBOLS.get(type(node.op), '?')} is not allowed")
        elif isinstance(node, ast.Call):
            _check_call(node)
        elif id(node) not in called:  # a called function's Name is judged by _check_call
            raise CalculatorError(_refusal(node))


def _check_literal(value: object) -> None:
    if type(value) not in (int, float):  # bool is a subclass of int: compare the type itself
        kind = {str: "text", bytes: "bytes", bool: "True or False", complex: "complex numbers"}.get(type(value))
        raise CalculatorError(f"only numbers are allowed, not {kind or repr(value)}")
    _check_magnitude(value, "the number")


def _check_call(node: ast.Call) -> None:
    if not isinstance(node.func, ast.Name):
        raise CalculatorError(f"only the functions {', '.join(_FUNCTIONS)} can be called; {_refusal(node.func)}")
    if node.func.id not in _FUNCTIONS:
        raise CalculatorError(
            f"the function {node.func.id!r} is not allowed; only {', '.join(_FUNCTIONS)} are available"
        )
    if node.keywords:
        raise CalculatorError(f"{node.func.id}() takes no keyword arguments")
    wanted = {"abs": (1, 1, "1 argument"), "round": (1, 2, "1 or 2 arguments")}
    low, high, words = wanted.get(node.func.id, (1, MAX_NODES, "at least 1 argument"))
    if not low <= len(node.args) <= high:
        raise CalculatorError(f"{node.func.id}() takes {words}, got {len(node.args)}")


def _refusal(node: ast.AST) -> str:
    """A message that names what ``node`` is and says it is not allowed."""
    if isinstance(node, ast.Name):
        return f"names are not allowed: {node.id!r} is not a number (variables are not supported)"
    if isinstance(node, ast.Attribute):
        return f"attribute access is not allowed: .{node.attr}"
    return _REFUSED.get(type(node), f"{type(node).__name__} expressions are not allowed")


def _evaluate(node: ast.expr) -> Number:
    """The value of a node ``_check_tree`` accepted, every intermediate result checked."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Call):
        return _call(node.func.id, [_evaluate(arg) for arg in node.args])
    if not isinstance(node, ast.BinOp):  # unreachable after _check_tree; kept as a guard
        raise CalculatorError(_refusal(node))
    left, right = _evaluate(node.left), _evaluate(node.right)
    symbol, apply = _BINARY[type(node.op)]
    if symbol in ("/", "//", "%") and right == 0:
        raise CalculatorError(f"division by zero: {format_number(left)} {symbol} 0")
    if symbol == "**":
        _check_power(left, right)
    if symbol == "/" and isinstance(left, int) and isinstance(right, int) and left % right == 0:
        value: Number = left // right  # exact, where a float would round past 2**53
    else:
        try:
            value = apply(left, right)
        except (OverflowError, ZeroDivisionError) as exc:
            raise CalculatorError(
                f"cannot compute {format_number(left)} {symbol} {format_number(right)}: {exc}"
            ) from None
    return _check_magnitude(value, "the result")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power before computing it when it is too large, complex, or a division by zero."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {format_number(exponent)} is too large: at most {MAX_EXPONENT} is allowed")
    if base == 0 and exponent < 0:
        raise CalculatorError(f"division by zero: 0 ** {format_number(exponent)}")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError(
            "a negative number to a fractional power is not a real number: "
            f"({format_number(base)}) ** {format_number(exponent)}"
        )
    # |base ** exponent| = 10 ** (exponent * log10|base|); the slack leaves the exact edge to _check_magnitude.
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE) + 1:
        raise CalculatorError(
            f"{format_number(base)} ** {format_number(exponent)} is too large: results are limited to 1e18"
        )


def _call(name: str, args: list[Number]) -> Number:
    if name == "abs":
        return abs(args[0])
    if name == "min":
        return min(args)
    if name == "max":
        return max(args)
    if len(args) == 1:
        return _check_magnitude(round(args[0]), "the result")  # round(x) is an int
    digits = args[1]
    if not isinstance(digits, int) or abs(digits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round()'s second argument must be a whole number from -18 to 18, got {digits}")
    return round(args[0], digits)


def _check_magnitude(value: Number, what: str) -> Number:
    if isinstance(value, float) and math.isnan(value):
        raise CalculatorError(f"{what} is not a number")
    if abs(value) > MAX_MAGNITUDE:
        size = f"({len(str(abs(value)))} digits)" if isinstance(value, int) else f"{value:.3g}"
        raise CalculatorError(f"{what} {size} is too large: numbers are limited to 1e18 in absolute value")
    return value
