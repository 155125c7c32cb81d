"""Multiplication and division word problems: answers recomputed, divisions exact, sizes kept, splits apart."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.tasks.rewards import math_reward
from asyncrl.tasks.synth import GROUP_SCENES, MULDIV_KINDS, NAMES, main, muldiv_problem

WORK = re.compile(r"(\d+) ([*/]) (\d+) = <<(\d+)([*/])(\d+)=(\d+)>>(\d+)")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def generate(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    main(["muldiv", *args, "--out", str(out)])
    return out


def digits(number: int) -> int:
    return len(str(number))


KNOBS = [
    {"min_digits": 2, "max_digits": 3, "kinds": MULDIV_KINDS},
    {"min_digits": 2, "max_digits": 2, "kinds": ("div",)},
    {"min_digits": 3, "max_digits": 3, "kinds": ("mul", "two-step")},
    {"min_digits": 1, "max_digits": 2, "kinds": ("two-step",)},
]


@pytest.mark.parametrize("knobs", KNOBS)
def test_labels_recomputed_from_the_numbers(knobs):
    rng = random.Random(3)
    low, high = knobs["min_digits"], knobs["max_digits"]
    for _ in range(400):
        problem = muldiv_problem(rng, **knobs)
        row = problem.row()
        groups, each, divisor = problem.groups, problem.each, problem.divisor
        total = groups * each
        assert problem.kind in knobs["kinds"] and problem.name in NAMES
        assert low <= digits(groups) <= high and low <= digits(each) <= high and min(groups, each) >= 2
        if problem.asks == "total":
            expected, stated = total, (groups, each)
        elif problem.asks == "each":
            expected, stated = total // groups, (total, groups)
            assert total % groups == 0 and expected == each
        elif problem.asks == "groups":
            expected, stated = total // each, (total, each)
            assert total % each == 0 and expected == groups
        else:
            expected, stated = total // divisor, (groups, each, divisor)
            assert total % divisor == 0 and expected >= 2
            assert low <= digits(divisor) <= high and divisor not in (groups, each)
        if problem.asks != "regrouped":
            assert divisor == 0
        assert row["label"] == str(expected) == str(problem.answer())
        assert row["answer"].endswith(f"\n#### {expected}")
        assert row["answer"].count("\n") == (2 if problem.asks == "regrouped" else 1)
        assert math_reward(row["answer"], row) == 1.0  # the worked solution is a correct response
        for number in stated:
            assert re.search(rf"(?<!\d){number}(?!\d)", row["question"]), (number, row["question"])


def test_written_rows_compute_what_they_say(tmp_path):
    """From the files alone: every worked line's arithmetic holds, every division is exact, the label is the last."""
    out = generate(tmp_path, "rows", "--train", "400", "--eval", "100", "--seed", "5")
    rows = read_jsonl(out / "train.jsonl") + read_jsonl(out / "eval.jsonl")
    kinds = Counter()
    for row in rows:
        assert list(row) == ["question", "answer", "label"]
        steps = WORK.findall(row["answer"])
        assert steps and len(steps) == row["answer"].count("\n")
        for left, symbol, right, left2, symbol2, right2, result, result2 in steps:
            assert (left, symbol, right, result) == (left2, symbol2, right2, result2)
            left, right, result = int(left), int(right), int(result)
            if symbol == "*":
                assert left * right == result and 2 <= digits(left) <= 3 and 2 <= digits(right) <= 3
                assert str(left) in row["question"] and str(right) in row["question"]
            else:
                assert left % right == 0 and left // right == result and 2 <= digits(right) <= 3
                if len(steps) == 1:  # one division: its answer is the other factor
                    assert 2 <= digits(result) <= 3
        assert row["label"] == steps[-1][6] and row["answer"].endswith(f"\n#### {row['label']}")
        kinds["".join(step[1] for step in steps)] += 1
    assert set(kinds) == {"*", "/", "*/"}  # multiply, divide, multiply then divide
    assert all(len(rows) / 5 < count < len(rows) / 2 for count in kinds.values())  # about a third each


@pytest.mark.parametrize("seed", [0, 1])
def test_division_problems_split_by_either_factor(seed):
    rng = random.Random(seed)
    asks = Counter(muldiv_problem(rng, kinds=("div",)).asks for _ in range(400))
    assert set(asks) == {"each", "groups"} and min(asks.values()) > 150


def test_uses_every_scene_and_sentence():
    rng = random.Random(0)
    used = set()
    for _ in range(3000):
        used.update(muldiv_problem(rng).templates())
    every = {
        sentence
        for scene in GROUP_SCENES
        for sentence in (*scene.made, *scene.total_question, *scene.shared, *scene.packed, *scene.regrouped)
    }
    assert used == every and len(every) > 50


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    args = ["--train", "300", "--eval", "50", "--seed", "7"]
    first, second = generate(tmp_path, "a", *args), generate(tmp_path, "b", *args)
    other = generate(tmp_path, "c", *args[:-1], "8")
    for split_name in ("train.jsonl", "eval.jsonl"):
        assert (first / split_name).read_bytes() == (second / split_name).read_bytes()
        assert (first / split_name).read_bytes() != (other / split_name).read_bytes()


def test_cli_writes_disjoint_splits_with_no_repeats(tmp_path, capsys):
    out = generate(tmp_path, "split", "--train", "400", "--eval", "100", "--seed", "1", "--max-digits", "2")
    assert "train.jsonl: 400 rows" in capsys.readouterr().out
    train = [row["question"] for row in read_jsonl(out / "train.jsonl")]
    evals = [row["question"] for row in read_jsonl(out / "eval.jsonl")]
    assert len(train) == 400 and len(evals) == 100
    assert len(set(train)) == 400 and len(set(evals)) == 100
    assert not set(train) & set(evals)


def test_eval_split_does_not_depend_on_train_size(tmp_path):
    small = generate(tmp_path, "small", "--train", "10", "--eval", "30")
    large = generate(tmp_path, "large", "--train", "200", "--eval", "30")
    assert (small / "eval.jsonl").read_bytes() == (large / "eval.jsonl").read_bytes()


def test_kinds_knob_limits_the_problems(tmp_path):
    out = generate(tmp_path, "mul", "--train", "50", "--eval", "10", "--kinds", "mul")
    rows = read_jsonl(out / "train.jsonl") + read_jsonl(out / "eval.jsonl")
    assert all(" * " in row["answer"] and " / " not in row["answer"] for row in rows)


@pytest.mark.parametrize(
    "args",
    [
        ["--min-digits", "3", "--max-digits", "2"],
        ["--kinds", "mul,add"],
        ["--kinds", ""],
        ["--max-digits", "5"],
    ],
)
def test_contradictory_or_unknown_knobs_end_the_program(tmp_path, args):
    with pytest.raises(SystemExit):
        generate(tmp_path, "bad", "--train", "5", "--eval", "5", *args)
    assert not (tmp_path / "bad").exists()
