"""Built-in verifiable rewards: ``reward(response, item) -> float``.

``item`` is the prompt's dict; ``item["label"]`` holds the dataset row's
label (a string or a number). ``REWARDS`` is the one place where the names a
config uses (``task.reward: math``, ``task.rewards: {math: 0.9, format:
0.1}``) map to functions; ``weighted`` builds a weighted sum of them.

None of these can hang a generator. Countdown expressions are checked with
``ast`` and evaluated on exact fractions (:mod:`asyncrl.tasks.countdown`). Math
answers are compared by math-verify, whose own timeouts use ``signal.alarm``
and so work only in the main thread (elsewhere it raises ``ValueError``
unless they are turned off), and which cannot interrupt sympy inside one
long C call (``9**(9**9)`` as an exact integer) in any thread. Such a call
holds the GIL too, so a caller's thread timeout cannot stop it either. So
``math_reward`` first refuses answers that could take unbounded time to
parse or compare (``_COSTLY_LATEX`` before parsing, ``_is_costly`` after),
then passes math-verify's timeouts in the main thread and turns them off
in any other thread, where the checks alone bound the work.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.countdown import countdown_reward
from asyncrl.tasks.hooks import resolve

if TYPE_CHECKING:
    from asyncrl.config import TaskConfig

Reward = Callable[[str, dict[str, Any]], float]

# math-verify's per-call limit in the main thread; signal.alarm counts whole seconds.
MATH_VERIFY_TIMEOUT_S = 2
# A longer final answer is scored 0 unread: it bounds parsing, and no label is this long.
MAX_ANSWER_CHARS = 256
# A numeric power tower whose exponents multiply past this, or a factorial of more, is refused.
MAX_EXPONENT = 1000
# A power of an expression with symbols (x, (x+1)) beyond this exponent is refused: sympy may expand it.
MAX_SYMBOLIC_EXPONENT = 100

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
# The last number of a text: a fraction (3/4) whole, and a leading-point decimal (.5) too.
_LAST_NUMBER = re.compile(rf"(?<![\w.]){_NUMBER}(?:/\d+(?!\.?\d))?|(?<![\w.])-?\.\d+")
# LaTeX spacing between digit groups, as in 1\,234 (a thousands separator in print).
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,!;: ]|~)(?=\d{3}(?!\d))")
_GSM8K_ANSWER = re.compile(rf"####\s*\$?\s*({_NUMBER})")
_BOXED_OR_BRACE = re.compile(r"\\boxed\s*\{|[{}]")
_FRACTION = re.compile(r"[-+]?\d{1,18}/\d{1,18}")
# A plain number, as a label or a boxed answer: 1,234 / -0.5 / 3 / 1e-05 (a float label's repr).
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d{1,3})?|[-+]?\.\d+")
# LaTeX that latex2sympy evaluates while parsing (binomial, Gamma, operatorname{zeros}(..), det)
# or that sympy may take unbounded time to compare (sums, products, integrals, limits).
_COSTLY_LATEX = re.compile(r"\\(?:[dt]?binom|choose|[Gg]amma|operatorname|det|sum|prod|i*int|oint|lim)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty ``\\boxed{...}``, nested braces included.

    ``last_boxed(r"so \\boxed{\\frac{1}{2}}.")`` is ``\\frac{1}{2}``; an
    unclosed ``\\boxed{12`` (a response cut off mid-answer) does not count.
    One pass over the braces, so it is linear in the response.
    """
    opened: list[int | None] = []  # per open brace: where its content starts if it opened a \boxed
    last: tuple[int, int] | None = None
    for match in _BOXED_OR_BRACE.finditer(text):
        token = match.group()
        if token == "}":
            start = opened.pop() if opened else None
            if start is not None and text[start : match.start()].strip() and (last is None or start > last[0]):
                last = (start, match.start())
        else:
            opened.append(None if token == "{" else match.end())
    return text[last[0] : last[1]].strip() if last else None


def extract_answer(response: str) -> str | None:
    """The response's final answer, or None when it states none.

    In order of precedence: the last ``\\boxed{...}`` (its content as written,
    ``\\frac{1}{2}``), else the last GSM8K ``#### N``, else the last number in
    the text; a number comes back without thousands separators::

        extract_answer("6 + 7 = 13, so \\boxed{13}. Check: 14")  -> "13"
        extract_answer("She pays $1,234.\\n#### 1,234")           -> "1234"
        extract_answer("3 apples and then -2.5 degrees")          -> "-2.5"
        extract_answer("no idea")                                 -> None
    """
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    gsm8k = _GSM8K_ANSWER.findall(response)
    if gsm8k:
        return gsm8k[-1].replace(",", "")
    numbers = _LAST_NUMBER.findall(response.replace("\u2212", "-"))  # Unicode's minus sign too
    return numbers[-1].replace(",", "") if numbers else None


def math_reward(response: str, item: dict[str, Any]) -> float:
    """1.0 if the response's final answer (``extract_answer``) equals ``item["label"]``, else 0.0.

    Two plain numbers are compared exactly as fractions (``"1,234"`` equals
    ``1234``, ``"3.0"`` equals ``"3"``, ``"0.333"`` is not ``"1/3"``).
    Anything else goes to math-verify, which parses both as LaTeX and
    accepts numeric and symbolic equivalence: ``\\frac{1}{2}`` equals
    ``"0.5"``, ``x = 3`` equals ``"3"``, and, by its convention, ``12\\%``
    equals both ``"12"`` and ``"0.12"``. A response with no number scores 0.
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, item["label"]) else 0.0


def format_reward(response: str, item: dict[str, Any]) -> float:
    """1.0 if the response states a final answer as ``\\boxed{...}`` or as a ``#### N`` line, else 0.0.

    ``"... \\boxed{7}"`` and ``"...\\n#### 7"`` score 1; ``"the answer is 7"``
    and an unclosed ``"\\boxed{7"`` score 0. The answer's value is not checked.
    """
    return 1.0 if last_boxed(response) is not None or _GSM8K_ANSWER.search(response) else 0.0


def answers_match(answer: str, label: str | float) -> bool:
    """Whether an extracted answer equals a label; see ``math_reward`` for the rules."""
    label = _float_label(label) if isinstance(label, float) else str(label).strip()
    answer = _DIGIT_GROUP_SPACE.sub("", answer)
    answer_number, label_number = _plain_number(answer), _plain_number(label)
    if answer_number is not None and label_number is not None:
        return answer_number == label_number
    if len(answer) > MAX_ANSWER_CHARS or _COSTLY_LATEX.search(answer):
        return False
    return _math_verify(answer, label)


def _float_label(label: float) -> str:
    """A float label as written: a float32 column's 0.3 arrives as 0.30000001192092896, so a value a float32
    holds exactly is written as float32's shortest form."""
    import numpy

    if not abs(label) <= float(numpy.finfo(numpy.float32).max):  # past float32 (or NaN): as written
        return repr(label)
    single = numpy.float32(label)
    if float(single) != label:
        return repr(label)
    return numpy.format_float_positional(single, unique=True, trim="-")  # 1000000, not 1e+06


def _plain_number(text: str) -> Fraction | None:
    text = text.strip()
    if len(text) > MAX_ANSWER_CHARS:  # int() refuses > 4300 digits
        return None
    if _FRACTION.fullmatch(text):
        numerator, denominator = text.split("/")
        return Fraction(int(numerator), int(denominator)) if int(denominator) else None
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    return Fraction(text.replace(",", "").rstrip("."))


def _math_verify(answer: str, label: str) -> bool:
    from math_verify import verify

    timeout_s = _timeout_s()
    gold = _parse_latex(label, timeout_s)
    predicted = _parse_latex(answer, timeout_s)
    if not gold or not predicted or any(not isinstance(p, str) and _is_costly(p) for p in predicted):
        return False
    return bool(verify(list(gold), list(predicted), timeout_seconds=timeout_s))


def _timeout_s() -> int | None:
    """math-verify's timeouts where its signal.alarm works, the main thread; None (off) elsewhere."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)  # a group's samples share one label; sympy objects are immutable
def _parse_latex(text: str, timeout_s: int | None) -> tuple[Any, ...]:
    """math-verify's parse of ``\\boxed{text}`` as LaTeX only.

    Boxing makes the whole text one LaTeX expression (unboxed, ``10,5``
    parses as 10.5 and ``1e3`` as 1). Plain-expression extraction is left
    out because it hands text to sympy's ``parse_expr``, which evaluates
    ``factorial(10**8)`` on the spot.
    """
    from math_verify import LatexExtractionConfig, parse

    return tuple(parse(f"\\boxed{{{text}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout_s))


def _is_costly(expr: Any) -> bool:
    """True for a parsed answer sympy could spend unbounded time on when comparing it.

    latex2sympy builds powers and factorials unevaluated, so ``9^{9^{9^{9}}}``
    parses at once, but comparing it never ends. Refused: a numeric power
    tower whose exponents multiply to more than ``MAX_EXPONENT``
    (``2^{10^{6}}``, ``((10^{99})^{99})^{99}``) or hold a power or factorial
    themselves; a factorial of anything but an integer up to ``MAX_EXPONENT``;
    sums, products, integrals and limits. ``x^{2}``, ``2^{10}``, ``5!``,
    ``(2^{3})^{2}`` and ``2^{\\frac{1}{2}}`` pass. Nodes are told apart by
    sympy's class names and ``is_*`` flags, so this module needs no sympy
    import of its own (it comes with math-verify).
    """
    for node in _nodes(expr):
        kind = type(node).__name__
        if kind in ("Sum", "Product", "Integral", "Limit"):
            return True
        if kind == "factorial":
            arg = node.args[0]
            if not (arg.is_Integer and abs(arg) <= MAX_EXPONENT):
                return True
        if getattr(node, "is_Pow", False) and node.free_symbols:  # (x+1)^{1000}: sympy may expand it
            exponent = node.args[1]
            if not exponent.free_symbols and _symbolic_power_too_large(exponent):  # x^{n} is never expanded
                return True
        elif getattr(node, "is_Pow", False):
            total, base = 1.0, node
            while getattr(base, "is_Pow", False):
                base, exponent = base.args
                size = _exponent_size(exponent)
                if size is None:
                    return True
                total *= max(size, 1.0)
            if total > MAX_EXPONENT or (type(base).__name__ == "factorial" and total > 1):
                return True
    return False


def _symbolic_power_too_large(exponent: Any) -> bool:
    """Whether a numeric exponent of a symbolic base is past ``MAX_SYMBOLIC_EXPONENT``, or cannot be sized
    safely (itself costly: sized only once the numeric checks have passed it)."""
    if _is_costly(exponent):
        return True
    try:
        return abs(complex(exponent.evalf(15))) > MAX_SYMBOLIC_EXPONENT
    except (TypeError, ValueError):
        return True


def _nodes(expr: Any) -> list[Any]:
    """Every sub-expression of a sympy object, matrix entries included."""
    found, stack = [], [expr]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(list(node) if getattr(node, "is_Matrix", False) else getattr(node, "args", ()))
    return found


def _exponent_size(exponent: Any) -> float | None:
    """|exponent| if it is cheap to know (no powers but reciprocals, no factorials), else None."""
    if not exponent.is_Number:
        for node in _nodes(exponent):
            if type(node).__name__ == "factorial" or (getattr(node, "is_Pow", False) and node.args[1] != -1):
                return None
    try:
        return abs(complex(exponent.evalf()))
    except (TypeError, ValueError):
        return None


# Registry -------------------------------------------------------------------

REWARDS: dict[str, Reward] = {
    "math": math_reward,
    "format": format_reward,
    "countdown": countdown_reward,
}


def as_reward(value: Any) -> float:
    """A reward function's result as a float. Text is refused, though float() would read "0.7": a reward that
    returns text most likely returns the extracted answer, not its score."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"the reward returned {type(value).__name__} {str(value)[:40]!r}, not a number")
    return float(value)


def unknown_reward(field: str, name: str, url: bool = False) -> ValueError:
    """The error for a reward ``name`` that is no built-in and no ``module:callable`` (nor, with ``url``, a
    reward model's URL)."""
    return ValueError(
        f"{field}: unknown reward {name!r}: neither a built-in reward ({', '.join(sorted(REWARDS))}) "
        "nor 'module:callable'" + (" nor a reward model's http(s):// URL" if url else "")
    )


def missing_reward(task: TaskConfig) -> str | None:
    """Why ``task`` has no reward, naming the keys and the built-in rewards; None when it has one."""
    if task.rewards or task.reward_name() is not None or task.env:
        return None  # an environment of the user's may score its episodes itself
    source = "task.dataset" if task.dataset else f"task.prompts ({task.prompts})"
    return (
        f"task.reward: not set, and {source} needs a reward: name a built-in one "
        f"({', '.join(sorted(REWARDS))}), a 'module:callable' or a reward model's http(s):// URL, "
        "or weigh several in task.rewards"
    )


def weighted(rewards: dict[str, float]) -> Reward:
    """A reward that is ``sum(weight * reward(response, item))`` over ``rewards``.

    Keys are names in ``REWARDS`` or ``module:callable`` references; every
    one is resolved here, so a typo fails at start-up, not at the first
    sample. ``weighted({"math": 0.9, "format": 0.1})`` scores a correct
    boxed answer 1.0, a correct unboxed one 0.9 and a wrong boxed one 0.1.
    """
    if not rewards:
        raise ValueError("task.rewards: expected at least one 'name: weight'")
    parts: list[tuple[Reward, float]] = []
    for name, weight in rewards.items():
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"task.rewards.{name}: expected a finite number as the weight, got {weight!r}")
        if name in REWARDS:
            parts.append((REWARDS[name], float(weight)))
        elif ":" in name:
            parts.append((resolve(name, f"task.rewards.{name}"), float(weight)))
        else:
            raise unknown_reward("task.rewards", name)

    def reward(response: str, item: dict[str, Any]) -> float:
        return sum(weight * fn(response, item) for fn, weight in parts)

    reward.__name__ = reward.__qualname__ = "weighted(" + ", ".join(f"{n}={w:g}" for n, w in rewards.items()) + ")"
    return reward
