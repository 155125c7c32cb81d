"""Built-in rewards: answer extraction, math-verify equivalence, Countdown safety, weighted sums."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from asyncrl.tasks.countdown import countdown_reward, extract_expression
from asyncrl.tasks.rewards import REWARDS, extract_answer, format_reward, math_reward, weighted


def score(response: str, label: str | float) -> float:
    return math_reward(response, {"label": label})


# extract_answer: \boxed beats ####, which beats the last number


def test_boxed_wins_over_gsm8k_and_later_numbers():
    response = "Step: 3 + 4 = 7, so \\boxed{7}.\n#### 9\nChecked in 12 seconds."
    assert extract_answer(response) == "7"
    assert score(response, "7") == 1.0
    assert score(response, "9") == 0.0 and score(response, "12") == 0.0


def test_gsm8k_line_wins_over_later_numbers():
    response = "She has 5 + 3 = 8 apples.\n#### 8\nThat took 2 minutes."
    assert extract_answer(response) == "8"
    assert score(response, "8") == 1.0 and score(response, "2") == 0.0


def test_last_number_is_the_fallback():
    response = "First 10, then 20, so the total is 30."
    assert extract_answer(response) == "30"
    assert score(response, "30") == 1.0 and score(response, "10") == 0.0


def test_last_boxed_counts_and_nested_braces_are_kept():
    response = "Try \\boxed{3}; no, it is \\boxed{\\frac{1}{2}} (the box {closes} here)"
    assert extract_answer(response) == "\\frac{1}{2}"


def test_unclosed_boxed_is_not_an_answer():
    # A response cut off inside its box: the box does not count, the #### line does.
    assert extract_answer("#### 4\nso \\boxed{5") == "4"


def test_negative_decimal_and_thousands():
    assert extract_answer("it went from 3 to -2.5 degrees") == "-2.5"
    assert extract_answer("5-3=2") == "2"  # a minus between numbers is not a sign
    assert extract_answer("The total is $1,234.") == "1234"
    assert score("The total is $1,234.", 1234) == 1.0
    assert score("The total is $1,234.", "1234") == 1.0
    assert score("#### 1,234", "1234") == 1.0


def test_no_number_scores_zero():
    assert extract_answer("I do not know.") is None
    assert score("I do not know.", "0") == 0.0


def test_wrong_answer_scores_zero():
    assert score("\\boxed{41}", "42") == 0.0
    assert score("#### 41", "42") == 0.0
    assert score("It is 41", 42) == 0.0


# equivalence


def test_latex_fraction_equals_decimal_label():
    assert score("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert score("\\boxed{\\dfrac{3}{4}}", 0.75) == 1.0
    assert score("\\boxed{\\frac{1}{2}}", "0.6") == 0.0


def test_plain_numbers_compare_exactly():
    assert score("\\boxed{3.0}", "3") == 1.0
    assert score("\\boxed{1e3}", "1000") == 1.0  # math-verify alone reads 1e3 as 1*e*3
    assert score("\\boxed{0.5000001}", "0.5") == 0.0


def test_latex_label_and_answer_forms():
    assert score("\\boxed{x = 3}", "3") == 1.0
    assert score("\\boxed{12 \\text{ apples}}", "12") == 1.0
    assert score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert score("\\boxed{\\sqrt{2}}", "\\sqrt{3}") == 0.0


def test_math_reward_works_off_the_main_thread():
    # math-verify's default timeouts raise ValueError outside the main thread.
    results = []
    thread = threading.Thread(target=lambda: results.append(score("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(30)
    assert results == [1.0]


COSTLY_ANSWERS = [
    "9^{9^{9^{9}}}",  # a tower: comparing it never ends
    "(10^{8})!",  # a huge factorial
    "((10^{99})^{99})^{99}",  # a tower written with parentheses
    "\\binom{100000000}{50000000}",  # latex2sympy evaluates it while parsing
    "\\Gamma(100000000)",  # likewise
    "\\begin{pmatrix}9^{9^{9}} & 1\\end{pmatrix}",  # a tower inside a matrix
]

SCORE_IN_BOTH_THREADS = """
import json, sys, threading
from asyncrl.tasks.rewards import math_reward
out = []
for answer in json.loads(sys.argv[1]):
    item, response = {"label": "5"}, "\\\\boxed{" + answer + "}"
    worker = []
    thread = threading.Thread(target=lambda: worker.append(math_reward(response, item)))
    thread.start()
    thread.join()
    out.append([math_reward(response, item), worker[0]])
print(json.dumps(out))
"""


def test_costly_answers_score_zero_quickly_in_any_thread(python):
    # In a child process: without the guards, sympy computes these exactly in C, holding the GIL, so
    # neither math-verify's signal timeout nor a thread join can stop it; only killing the process can.
    start = time.monotonic()
    done = subprocess.run(
        [python, "-c", SCORE_IN_BOTH_THREADS, json.dumps(COSTLY_ANSWERS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[0.0, 0.0]] * len(COSTLY_ANSWERS)
    assert time.monotonic() - start < 30


def test_small_powers_and_factorials_still_count():
    assert score("\\boxed{2^{10}}", "1024") == 1.0
    assert score("\\boxed{(2^{3})^{2}}", "64") == 1.0
    assert score("\\boxed{5!}", "120") == 1.0


# format_reward


def test_format_reward():
    assert format_reward("so \\boxed{7}", {}) == 1.0
    assert format_reward("so it is 7\n#### 7", {}) == 1.0
    assert format_reward("the answer is 7", {}) == 0.0
    assert format_reward("so \\boxed{7", {}) == 0.0
    assert format_reward("so \\boxed{}", {}) == 0.0


# countdown_reward

ITEM = {"numbers": [3, 5, 25], "target": 60, "label": "60"}


def countdown(response: str, item: dict = ITEM) -> float:
    return countdown_reward(response, item)


def test_countdown_correct_expression():
    assert countdown("<think>25 - 5 = 20, times 3</think> <answer>(25 - 5) * 3</answer>") == 1.0
    assert countdown("<answer> (25 - 5) * 3 = 60 </answer>") == 1.0
    assert countdown("<answer>3 * (25 - 5)</answer>", {"numbers": [3, 5, 25], "label": "60"}) == 1.0
    # the stated result written with a thousands separator is the same number
    assert countdown("<answer>25 * 40 = 1,000</answer>", {"numbers": [25, 40], "target": 1000}) == 1.0
    assert countdown("<answer>25 * 40 = 1,001</answer>", {"numbers": [25, 40], "target": 1000}) == 0.0


def test_countdown_last_expression_line_without_tags():
    assert extract_expression("I try 25 * 3 - 5 = 70.\n$(25 - 5) * 3$\nDone!") == "(25 - 5) * 3"
    assert countdown("I try 25 * 3 - 5 = 70.\n$(25 - 5) * 3$\nDone!") == 1.0


def test_countdown_wrong_target_scores_zero():
    assert countdown("<answer>25 * 3 - 5</answer>") == 0.0  # 70
    assert countdown("<answer>(25 - 5) * 3 = 61</answer>") == 0.0  # states the wrong target


def test_countdown_numbers_each_exactly_once():
    assert countdown("<answer>(25 - 5) * 3 * 3 / 3</answer>") == 0.0  # 3 reused
    assert countdown("<answer>25 + 35</answer>") == 0.0  # 35 is not given
    assert countdown("<answer>(25 - 5) * 3</answer>", {**ITEM, "numbers": [3, 5, 25, 7]}) == 0.0  # 7 unused


def test_countdown_division_is_exact_and_by_zero_scores_zero():
    assert countdown("<answer>(8 / 4) / 2</answer>", {"numbers": [2, 4, 8], "target": 1}) == 1.0
    assert countdown("<answer>2 / 4 * 8</answer>", {"numbers": [2, 4, 8], "target": 4}) == 1.0  # 1/2 * 8
    assert countdown("<answer>4 / (2 - 2)</answer>", {"numbers": [2, 2, 4], "target": 4}) == 0.0


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",  # no names or calls
        "(25.0 - 5) * 3",  # integers only
        "(" * 300 + "3" + ")" * 300,  # too deep / too long
    ],
)
def test_countdown_refuses_anything_but_arithmetic(expression):
    assert countdown(f"<answer>{expression}</answer>") == 0.0


def test_countdown_power_and_floor_division_are_refused_even_when_the_value_is_right():
    assert countdown("<answer>5 ** 2 + 3 * 25 - 40</answer>", {"numbers": [5, 2, 3, 25, 40], "target": 60}) == 0.0
    assert countdown("<answer>5 * 5 + 3 * 25 - 40</answer>", {"numbers": [5, 5, 3, 25, 40], "target": 60}) == 1.0
    assert countdown("<answer>30 * (7 // 2)</answer>", {"numbers": [7, 2, 30], "target": 90}) == 0.0
    assert countdown("<answer>30 * (7 - 2 * 2)</answer>", {"numbers": [7, 2, 2, 30], "target": 90}) == 1.0


def test_countdown_without_an_expression_scores_zero():
    assert countdown("I could not find one.") == 0.0


# weighted and the registry


def test_weighted_math_and_format():
    reward = weighted({"math": 0.8, "format": 0.2})
    item = {"label": "5"}
    assert reward("\\boxed{5}", item) == pytest.approx(1.0)
    assert reward("it is 5", item) == pytest.approx(0.8)  # right, unformatted
    assert reward("\\boxed{4}", item) == pytest.approx(0.2)  # formatted, wrong
    assert reward("no idea", item) == 0.0


def test_weighted_accepts_module_references():
    reward = weighted({"format": 1.0, "asyncrl.tasks.digits:digit_reward": 0.5})
    assert reward("123", {"answer": "123"}) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "rewards, message",
    [
        ({}, "at least one"),
        ({"maths": 1.0}, "unknown reward 'maths'"),
        ({"math": float("nan")}, "finite number"),
        ({"no_such_module:fn": 1.0}, "cannot import"),
    ],
)
def test_weighted_rejects_bad_configs_at_build_time(rewards, message):
    with pytest.raises(ValueError, match=message):
        weighted(rewards)


def test_registry_names():
    assert REWARDS == {"math": math_reward, "format": format_reward, "countdown": countdown_reward}


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The answer is 3/4.", "3/4", 1.0),  # a fraction is read whole
        ("The answer is 3/4.", "4", 0.0),  # not as its denominator
        ("The answer is 3/4.", "0.75", 1.0),
        ("The answer is \u22123", "-3", 1.0),  # Unicode's minus sign
        ("The answer is \u22123", "3", 0.0),
        ("so the answer is .5", "0.5", 1.0),
        (r"\boxed{1\,234}", "1234", 1.0),  # LaTeX's thin space between digit groups
        ("on 12/25 she paid 7", "7", 1.0),
    ],
)
def test_the_last_number_reads_fractions_signs_and_point_decimals(response, label, expected):
    assert score(response, label) == expected


def test_a_float32_columns_label_matches_the_decimal_it_stands_for():
    import numpy

    assert score(r"\boxed{0.3}", float(numpy.float32(0.3))) == 1.0  # 0.30000001192092896 as a Python float
    assert score(r"\boxed{0.1}", 0.1) == 1.0 and score(r"\boxed{0.3}", 0.30000000000000004) == 0.0


def test_a_large_power_of_a_symbolic_expression_is_refused_before_sympy_expands_it():
    done: list[float] = []
    thread = threading.Thread(target=lambda: done.append(score(r"\boxed{(x+1)^{100000}}", "5")), daemon=True)
    thread.start()
    thread.join(timeout=20)  # unbounded before: sympy expanded it in a thread where math-verify has no timeout
    assert done == [0.0]
    assert score(r"\boxed{x^{n}}", "x^n") == 1.0 and score(r"\boxed{(x+1)^{2}}", "(x+1)^2") == 1.0


def test_countdown_reads_tinyzeros_nums_and_refuses_numbers_that_are_not_a_list():
    assert countdown_reward("<answer>-3 + 5</answer>", {"nums": [-3, 5], "target": 2}) == 1.0
    with pytest.raises(ValueError, match="numbers .* must be a list of integers, not '\\[3, 5, 25\\]'"):
        countdown_reward("<answer>(25 - 5) * 3</answer>", {"numbers": "[3, 5, 25]", "target": 60})


def test_a_float_label_of_a_million_matches_however_the_answer_writes_it():
    assert score(r"\boxed{1{,}000{,}000}", 1e6) == 1.0 and score(r"\boxed{10^{6}}", 1e6) == 1.0  # not "1e+06"


def test_symbolic_powers_with_small_numeric_exponents_are_compared_and_large_ones_refused():
    assert score(r"\boxed{x^{\sqrt{2}}}", r"x^{\sqrt{2}}") == 1.0 and score(r"\boxed{x^{2^{2}}}", "x^4") == 1.0
    assert score(r"\boxed{(x+1)^{2^{10}}}", "5") == 0.0  # 1,024: refused before sympy could expand it


def test_countdown_tells_a_negative_number_from_a_positive_one_and_reads_a_decimal_target():
    assert countdown_reward("<answer>3 + 5</answer>", {"nums": [-3, 5], "target": 8}) == 0.0  # -3 never used
    assert countdown_reward("<answer>25 + -5</answer>", {"numbers": [25, 5], "target": 20}) == 1.0
    assert countdown_reward("<answer>(25 - 5) * 3 = 60.0</answer>", {"numbers": [3, 5, 25], "target": 60}) == 1.0
