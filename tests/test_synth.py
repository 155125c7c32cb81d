"""Synthetic datasets: determinism, disjoint splits, answers recomputed from structure, data/ reproducible."""

from __future__ import annotations

import json
import operator
import random
import shlex
from pathlib import Path

import pytest

from asyncrl.tasks.rewards import countdown_reward, math_reward
from asyncrl.tasks.synth import SCENES, arith_problem, countdown_problem, main, split

ROOT = Path(__file__).resolve().parents[1]
APPLY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def generate(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    main([*args, "--out", str(out)])
    return out


# determinism and splits


@pytest.mark.parametrize("kind", ["arith", "countdown", "copy"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, kind):
    args = [kind, "--train", "300", "--eval", "50", "--seed", "7"]
    first, second = generate(tmp_path, "a", *args), generate(tmp_path, "b", *args)
    other = generate(tmp_path, "c", *args[:-1], "8")
    for split_name in ("train.jsonl", "eval.jsonl"):
        assert (first / split_name).read_bytes() == (second / split_name).read_bytes()
        assert (first / split_name).read_bytes() != (other / split_name).read_bytes()


@pytest.mark.parametrize("kind", ["arith", "countdown", "copy"])
def test_train_and_eval_are_disjoint_and_have_no_repeats(tmp_path, kind):
    knobs = {
        "arith": ["--max-steps", "1", "--max-digits", "1"],
        "countdown": ["--max-number", "20"],
        "copy": ["--digits", "3"],
    }[kind]
    out = generate(tmp_path, kind, kind, "--train", "400", "--eval", "100", "--seed", "1", *knobs)
    train = [row["question"] for row in read_jsonl(out / "train.jsonl")]
    evals = [row["question"] for row in read_jsonl(out / "eval.jsonl")]
    assert len(train) == 400 and len(evals) == 100
    assert len(set(train)) == 400 and len(set(evals)) == 100
    assert not set(train) & set(evals)


def test_split_skips_repeats_within_and_across_splits():
    # 60 possible questions, 60 asked for: every draw after the first few collides with an earlier one.
    train, evals = split(lambda rng: {"question": str(rng.randrange(60))}, random.Random(0), 40, 20)
    questions = [row["question"] for row in evals + train]
    assert sorted(questions, key=int) == [str(i) for i in range(60)]


def test_eval_split_does_not_depend_on_train_size(tmp_path):
    small = generate(tmp_path, "small", "countdown", "--train", "10", "--eval", "30")
    large = generate(tmp_path, "large", "countdown", "--train", "200", "--eval", "30")
    assert (small / "eval.jsonl").read_bytes() == (large / "eval.jsonl").read_bytes()


def test_too_few_distinct_questions_is_an_error_not_a_hang():
    def make(rng: random.Random) -> dict:
        return countdown_problem(rng, count=3, min_number=1, max_number=2, max_target=100).row()

    with pytest.raises(ValueError, match="distinct questions"):
        split(make, random.Random(0), train_size=50, eval_size=10)


# arith: every label recomputed from the problem's own numbers


ARITH_KNOBS = [
    {"min_steps": 1, "max_steps": 2, "min_digits": 1, "max_digits": 2, "ops": ("add", "sub", "mul")},
    {"min_steps": 4, "max_steps": 4, "min_digits": 1, "max_digits": 2, "ops": ("sub",)},
    {"min_steps": 2, "max_steps": 3, "min_digits": 3, "max_digits": 3, "ops": ("add", "mul")},
    {
        "min_steps": 1,
        "max_steps": 4,
        "min_digits": 1,
        "max_digits": 3,
        "ops": ("add", "sub", "mul"),
        "allow_negative": True,
    },
]


@pytest.mark.parametrize("knobs", ARITH_KNOBS)
def test_arith_labels_recomputed_from_structure(knobs):
    rng = random.Random(3)
    for _ in range(300):
        problem = arith_problem(rng, **knobs)
        row = problem.row()
        values = [problem.start]
        for op, operand in problem.steps:
            values.append(APPLY[op](values[-1], operand))
        assert row["label"] == str(values[-1])
        assert row["answer"].endswith(f"\n#### {values[-1]}")
        assert row["answer"].count("\n") == len(problem.steps)  # one worked line per step, then ####
        assert knobs["min_steps"] <= len(problem.steps) <= knobs["max_steps"]
        assert {op for op, _ in problem.steps} <= set(knobs["ops"])
        for number in [problem.start, *(operand for _, operand in problem.steps)]:
            assert knobs["min_digits"] <= len(str(number)) <= knobs["max_digits"]
            assert str(number) in row["question"]
        assert min(problem.start, *(operand for _, operand in problem.steps)) >= 2
        if not (knobs.get("allow_negative") and SCENES[problem.scene].signed):
            assert min(values) >= 0


def test_arith_negative_values_only_when_allowed_and_only_in_signed_stories():
    rng = random.Random(5)
    knobs = {"min_steps": 3, "max_steps": 4, "min_digits": 1, "max_digits": 2, "ops": ("sub",)}
    went_negative = []
    for _ in range(500):
        problem = arith_problem(rng, **knobs, allow_negative=True)
        if min(problem.values()) < 0:
            went_negative.append(problem)
    assert went_negative
    assert all(SCENES[p.scene].signed for p in went_negative)
    assert all(min(arith_problem(rng, **knobs).values()) >= 0 for _ in range(500))


def test_arith_uses_every_story_and_sentence():
    rng = random.Random(0)
    used = set()
    for _ in range(3000):
        problem = arith_problem(rng, max_steps=4)
        scene, pick = SCENES[problem.scene], iter(problem.phrasing)
        used.add(scene.start[next(pick)])
        used.update(getattr(scene, op)[next(pick)] for op, _ in problem.steps)
        used.add(scene.question[next(pick)])
    every = {t for scene in SCENES for t in (*scene.start, *scene.add, *scene.sub, *scene.mul, *scene.question)}
    assert used == every and len(every) > 100


# countdown: every instance solvable with its own solution


@pytest.mark.parametrize("count, low, high, max_target", [(3, 1, 99, 100), (4, 1, 99, 100), (4, 1, 25, 1000)])
def test_countdown_solution_reaches_target(count, low, high, max_target):
    rng = random.Random(11)
    for _ in range(300):
        row = countdown_problem(rng, count, low, high, max_target).row()
        assert len(row["numbers"]) == count and all(low <= n <= high for n in row["numbers"])
        assert 1 <= row["target"] <= max_target and row["label"] == str(row["target"])
        assert countdown_reward(f"<answer>{row['solution']}</answer>", row) == 1.0
        assert str(row["numbers"]) in row["question"] and f"equals {row['target']}." in row["question"]


# the committed data/ files


def readme_commands() -> list[list[str]]:
    lines = (ROOT / "data" / "README.md").read_text(encoding="utf-8").splitlines()
    return [shlex.split(line)[3:] for line in lines if line.startswith("python -m asyncrl.tasks.synth ")]


def test_readme_commands_regenerate_data_byte_for_byte(tmp_path):
    commands = readme_commands()
    assert sorted(args[0] for args in commands) == ["arith", "arith", "arith", "copy", "countdown", "muldiv"]
    for args in commands:
        out = Path(args[args.index("--out") + 1])
        args[args.index("--out") + 1] = str(tmp_path / out.name)
        main(args)
        for split_name in ("train.jsonl", "eval.jsonl"):
            assert (tmp_path / out.name / split_name).read_bytes() == (ROOT / out / split_name).read_bytes()


@pytest.mark.parametrize(
    "name, train, evals",
    [
        ("arith", 2000, 200),
        ("arith-bare", 3000, 200),
        ("arith-story1", 3000, 200),
        ("countdown", 1000, 100),
        ("muldiv", 3000, 200),
    ],
)
def test_committed_data_sizes_and_answers(name, train, evals):
    folder = ROOT / "data" / name
    assert all((folder / f).stat().st_size < 1_000_000 for f in ("train.jsonl", "eval.jsonl"))
    train_rows, eval_rows = read_jsonl(folder / "train.jsonl"), read_jsonl(folder / "eval.jsonl")
    assert (len(train_rows), len(eval_rows)) == (train, evals)
    for row in train_rows + eval_rows:
        if name == "countdown":
            assert countdown_reward(f"<answer>{row['solution']}</answer>", row) == 1.0
        else:
            assert row["answer"].rsplit("\n#### ", 1)[1] == row["label"]
            assert math_reward(row["answer"], row) == 1.0  # the worked solution is a correct response


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bare_rows_ask_for_the_expression_the_steps_compute(seed):
    rng = random.Random(seed)
    for _ in range(300):
        problem = arith_problem(rng, min_steps=1, max_steps=3, max_digits=2)
        row, story = problem.row("bare"), problem.row()
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert set(expression) <= set("0123456789+-*() "), row["question"]
        # Python's precedence reads the parentheses the generator put in; steps apply in order.
        assert str(eval(expression)) == row["label"] == story["label"] == str(problem.values()[-1])
        assert row["answer"].endswith(f"\n#### {row['label']}") and math_reward(row["answer"], row) == 1.0


def test_copy_rows_ask_for_their_own_digits(tmp_path):
    out = generate(tmp_path, "copy", "copy", "--train", "50", "--eval", "10", "--seed", "3", "--digits", "4")
    for row in read_jsonl(out / "train.jsonl") + read_jsonl(out / "eval.jsonl"):
        digits = row["question"].removesuffix("=")
        assert len(digits) == 4 and digits.isdigit() and row["answer"] == f"#### {digits}" and row["label"] == digits
