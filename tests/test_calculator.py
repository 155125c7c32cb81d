"""The calculator tool: exact values, every refusal with a message that names the problem, bounded cost."""

from __future__ import annotations

import pytest

from asyncrl.envs.calculator import (
    MAX_EXPRESSION_CHARS,
    MAX_NODES,
    CalculatorError,
    calculator,
    evaluate,
    format_number,
)


@pytest.mark.parametrize(
    "expression, result",
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 * 3 ** 2", "18"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-3 ** 2", "-9"),  # the power binds tighter than the unary minus
        ("(-3) ** 2", "9"),
        ("--5", "5"),
        ("+7 - -2", "9"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),  # floor, not truncation
        ("7 % 3", "1"),
        ("-7 % 3", "2"),
        ("128 * 36", "4608"),
        ("4608 / 12", "384"),
        ("12 / 4", "3"),  # a whole quotient reads as an int
        ("(128 * 36) / 12", "384"),
        ("1 / 3", "0.3333333333"),
        ("2 / 3", "0.6666666667"),
        ("0.1 + 0.2", "0.3"),
        ("2.5 * 4", "10"),
        ("7.5 / 2", "3.75"),
        ("2 ** -3", "0.125"),
        ("2 ** 0.5", "1.414213562"),
        ("999999999999999999 / 1", "999999999999999999"),  # exact: no detour through a float
        ("999999999 * 999999999", "999999998000000001"),
        ("10 ** 18", "1000000000000000000"),
        ("-(10 ** 18)", "-1000000000000000000"),
        ("1_000 + 0x10", "1016"),
        ("abs(-5)", "5"),
        ("abs(-2.5)", "2.5"),
        ("round(2.567, 2)", "2.57"),
        ("round(7 / 2)", "4"),
        ("round(1234, -2)", "1200"),
        ("min(3, 1, 2)", "1"),
        ("max(2, 7.5, -1)", "7.5"),
        ("max(abs(-3), 2) * 10", "30"),
        ("  1 + 1  ", "2"),
    ],
)
def test_values(expression, result):
    assert calculator(expression) == result


def test_evaluate_keeps_ints_exact_and_floats_as_floats():
    assert evaluate("12 / 4") == 3 and isinstance(evaluate("12 / 4"), int)
    assert isinstance(evaluate("12 / 5"), float)
    assert format_number(3.0) == "3" and format_number(-0.0) == "0" and format_number(2.0 / 3) == "0.6666666667"
    assert format_number(1.5e17) == "1.5e+17"  # too large to be sure every digit of the float means something


@pytest.mark.parametrize(
    "expression, named",
    [
        ("__import__('os')", "'__import__' is not allowed"),
        ("__import__('os').system('ls')", "attribute access is not allowed: .system"),
        ("().__class__", "attribute access is not allowed: .__class__"),
        ("(1).real", "attribute access is not allowed: .real"),
        ("a + 1", "names are not allowed: 'a'"),
        ("abs", "names are not allowed: 'abs'"),
        ("max(abs, 1)", "names are not allowed: 'abs'"),
        ("print(1)", "'print' is not allowed"),
        ("[1]", "lists are not allowed"),
        ("(1, 2)", "tuples are not allowed"),
        ("{}", "dicts are not allowed"),
        ("{1}", "sets are not allowed"),
        ("x[0]", "subscripts"),
        ("lambda: 1", "lambdas are not allowed"),
        ("[x for x in range(9)]", "comprehensions are not allowed"),
        ("sum(x for x in range(9))", "'sum' is not allowed"),
        ("1 < 2", "comparisons are not allowed"),
        ("1 and 2", "and, or are not allowed"),
        ("1 if 2 else 3", "conditional expressions"),
        ("'a' * 3", "not text"),
        ("f'{1}'", "f-strings are not allowed"),
        ("True + 1", "not True or False"),
        ("2j", "not complex numbers"),
        ("1 << 3", "operator << is not allowed"),
        ("~1", "operator ~ is not allowed"),
        ("abs(1, 2)", "abs() takes 1 argument, got 2"),
        ("round(1.5, ndigits=1)", "no keyword arguments"),
        ("min()", "at least 1 argument"),
        ("round(1.5, 100)", "round()'s second argument"),
        ("1 +", "not a valid arithmetic expression"),
        ("x = 1", "not a valid arithmetic expression"),
        ("import os", "not a valid arithmetic expression"),
        ("", "empty"),
    ],
)
def test_refusals_name_what_is_not_allowed(expression, named):
    with pytest.raises(CalculatorError) as caught:
        calculator(expression)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "expression, named",
    [
        ("9**9**9", "exponent 387420489 is too large"),
        ("2**10**10", "exponent 10000000000 is too large"),
        ("10**400", "exponent 400 is too large"),
        ("10**19", "the result (20 digits) is too large"),
        ("10**20", "10 ** 20 is too large"),
        ("(10**9)**64", "is too large"),
        ("0.001 ** -64", "is too large"),
        ("2**64", "is too large"),
        ("(10**9) * (10**9) * 10", "the result (20 digits) is too large"),
        ("10**18 + 1", "the result (19 digits) is too large"),
        ("1" * 30, "the number (30 digits) is too large"),
        ("1e999", "the number inf is too large"),
        ("1e18 / 1e-300", "the result inf is too large"),
        ("1e18 // 1e-300", "too large"),
    ],
)
def test_huge_numbers_are_refused_before_they_are_computed(expression, named):
    # Computed in full, 9**9**9 alone would take minutes and gigabytes; each of these returns at once.
    with pytest.raises(CalculatorError) as caught:
        calculator(expression)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "expression, named",
    [
        ("1/0", "division by zero: 1 / 0"),
        ("5 // 0", "division by zero: 5 // 0"),
        ("5 % 0.0", "division by zero: 5 % 0"),
        ("1 / (3 - 3)", "division by zero"),
        ("0 ** -1", "division by zero: 0 ** -1"),
        ("(-8) ** (1 / 3)", "not a real number"),
    ],
)
def test_undefined_results_are_refused(expression, named):
    with pytest.raises(CalculatorError) as caught:
        calculator(expression)
    assert named in str(caught.value)


def test_size_limits():
    with pytest.raises(CalculatorError, match="10000 characters long; at most 200"):
        calculator("1+" * 4999 + "11")
    with pytest.raises(CalculatorError, match="characters long"):
        calculator("(" * 5000 + "1" + ")" * 5000)  # refused before the parser sees the nesting
    assert calculator(" " * (MAX_EXPRESSION_CHARS - 1) + "1") == "1"
    many = "+".join(["1"] * 60)  # 119 parts, 119 characters
    with pytest.raises(CalculatorError, match=f"119 parts; at most {MAX_NODES}"):
        calculator(many)


def test_the_error_is_a_value_error_and_the_input_must_be_text():
    assert issubclass(CalculatorError, ValueError)
    with pytest.raises(CalculatorError, match="must be text"):
        calculator(12)  # type: ignore[arg-type]


def test_transformers_reads_its_tool_schema():
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    schema = get_json_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["description"].startswith("Evaluate an arithmetic expression")
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"expression": schema["function"]["parameters"]["properties"]["expression"]},
        "required": ["expression"],
    }
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["function"]["return"]["type"] == "string"
