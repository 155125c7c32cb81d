"""Synthetic verifiable datasets: GSM8K-style arithmetic and Countdown.

    python -m asyncrl.tasks.synth arith --out data/arith --train 2000 --eval 200 --seed 0
    python -m asyncrl.tasks.synth countdown --out data/countdown --train 1000 --eval 100 --seed 0

writes ``DIR/train.jsonl`` and ``DIR/eval.jsonl``. The output is a function
of the arguments alone (one ``random.Random(seed)``; ``json.dumps`` in a
fixed key order), so a command regenerates its files byte for byte. The
eval rows are drawn first, then the train rows, skipping any question
already drawn: no question appears twice, within a split or across them,
and the eval split stays the same when only ``--train`` changes.

Each row is built from a structured problem (``ArithProblem``,
``CountdownProblem``) whose answer is computed from its numbers, never read
back from text; the tests recompute it from the same structure.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

NAMES = (
    "Ava",
    "Ben",
    "Carla",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Yusuf",
)

SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
APPLY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


@dataclass(frozen=True)
class Scene:
    """One story an arithmetic problem is told in.

    Sentences take ``{name}`` and ``{x}`` (a number). ``state`` is a clause
    for the worked solution, where ``{x}`` becomes ``12 + 5 = <<12+5=17>>17``.
    ``signed`` scenes (scores, temperatures, balances) are the only ones
    where ``--allow-negative`` lets a value drop below zero; a scene with no
    ``mul`` sentences is never given a multiplication.
    """

    start: tuple[str, ...]
    state: str
    question: tuple[str, ...]
    add: tuple[str, ...]
    sub: tuple[str, ...]
    mul: tuple[str, ...] = ()
    signed: bool = False


SCENES = (
    Scene(
        start=("{name} has {x} apples.", "{name} picks {x} apples at the orchard."),
        state="{name} has {x} apples",
        question=("How many apples does {name} have now?",),
        add=("{name} picks {x} more apples.", "A neighbour gives {name} {x} apples."),
        sub=("{name} eats {x} of the apples.", "{name} gives {x} apples to a friend."),
        mul=("By the end of the week, {name} has {x} times as many apples as before.",),
    ),
    Scene(
        start=("A train leaves the first station with {x} passengers on board.",),
        state="there are {x} passengers on the train",
        question=("How many passengers are on the train now?", "How many passengers does the train carry now?"),
        add=("At the next stop, {x} passengers get on.", "{x} more passengers board at the following station."),
        sub=("At the next stop, {x} passengers get off.", "{x} passengers leave the train at the following station."),
        mul=("At the central station, the number of passengers becomes {x} times as large.",),
    ),
    Scene(
        start=("{name} has ${x} in a piggy bank.", "{name} starts the month with ${x} in savings."),
        state="{name} has {x} dollars",
        question=("How many dollars does {name} have now?",),
        add=("{name} earns ${x} walking dogs.", "{name}'s aunt sends ${x} as a birthday gift."),
        sub=("{name} spends ${x} on a video game.", "{name} pays ${x} for a concert ticket."),
        mul=("After a year of saving, {name} has {x} times as much money as before.",),
    ),
    Scene(
        start=("A school library has {x} books on one shelf.",),
        state="the shelf holds {x} books",
        question=("How many books are on the shelf now?",),
        add=("The librarian adds {x} new books to the shelf.", "Students return {x} books to the shelf."),
        sub=("Students borrow {x} books from the shelf.", "{x} damaged books are removed from the shelf."),
        mul=("After a donation, the shelf holds {x} times as many books as before.",),
    ),
    Scene(
        start=("{name} bakes {x} cookies for a fair.",),
        state="{name} has {x} cookies",
        question=("How many cookies does {name} have now?",),
        add=("{name} bakes another {x} cookies.", "A friend brings {name} {x} more cookies."),
        sub=("{name} sells {x} cookies in the first hour.", "The family eats {x} of the cookies."),
        mul=("For a bigger fair, {name} scales up so there are {x} times as many cookies as before.",),
    ),
    Scene(
        start=("A parking lot has {x} cars in it.",),
        state="there are {x} cars in the lot",
        question=("How many cars are in the parking lot now?",),
        add=("{x} more cars drive in.", "In the afternoon, {x} cars arrive."),
        sub=("{x} cars leave the lot.", "At lunchtime, {x} cars drive away."),
        mul=("During the festival, the number of cars grows to {x} times what it was.",),
    ),
    Scene(
        start=("{name} has a bag of {x} marbles.",),
        state="{name} has {x} marbles",
        question=("How many marbles does {name} have now?",),
        add=("{name} wins {x} marbles in a game.", "A cousin gives {name} {x} marbles."),
        sub=("{name} loses {x} marbles.", "{name} trades away {x} marbles."),
        mul=("After a month of collecting, {name} has {x} times as many marbles as before.",),
    ),
    Scene(
        start=("A farm has {x} chickens.",),
        state="the farm has {x} chickens",
        question=("How many chickens does the farm have now?",),
        add=("The farmer buys {x} more chickens.", "{x} chicks hatch and join the flock."),
        sub=("The farmer sells {x} chickens.", "{x} chickens are moved to another farm."),
        mul=("A few years later, the flock is {x} times as large as before.",),
    ),
    Scene(
        start=("A water tank holds {x} liters of water.",),
        state="the tank holds {x} liters",
        question=("How many liters of water are in the tank now?",),
        add=("Rain adds {x} liters to the tank.", "{name} pours in another {x} liters."),
        sub=("{name} uses {x} liters to water the garden.", "{x} liters leak out of the tank."),
        mul=("A bigger pump fills the tank until it holds {x} times as much water as before.",),
    ),
    Scene(
        start=("A teacher has a box of {x} pencils.",),
        state="the teacher has {x} pencils",
        question=("How many pencils does the teacher have now?",),
        add=("The teacher buys {x} more pencils.", "{name} donates {x} pencils to the class."),
        sub=("The teacher hands out {x} pencils.", "The students use up {x} pencils."),
        mul=("Before exam week, the teacher stocks up until there are {x} times as many pencils.",),
    ),
    Scene(
        start=("A shop has {x} T-shirts in stock.",),
        state="the shop has {x} T-shirts",
        question=("How many T-shirts does the shop have in stock now?",),
        add=("A delivery brings {x} more T-shirts.", "{name} unpacks a box of {x} T-shirts."),
        sub=("The shop sells {x} T-shirts on Saturday.", "{x} T-shirts are sent back to the factory."),
        mul=("Before the holidays, the shop increases its stock to {x} times as many T-shirts.",),
    ),
    Scene(
        start=("An aquarium has {x} fish.",),
        state="the aquarium has {x} fish",
        question=("How many fish are in the aquarium now?",),
        add=("{name} adds {x} new fish.", "{x} baby fish are born."),
        sub=("{name} gives {x} fish to a friend.", "{x} fish are moved to a second tank."),
        mul=("After the breeding season, there are {x} times as many fish as before.",),
    ),
    Scene(
        start=("{name} collects stamps and has {x} of them.",),
        state="{name} has {x} stamps",
        question=("How many stamps does {name} have now?",),
        add=("{name} buys {x} stamps at a fair.", "A pen pal sends {name} {x} stamps."),
        sub=("{name} gives {x} stamps to a younger brother.", "{name} swaps away {x} stamps."),
        mul=("After inheriting a collection, {name} has {x} times as many stamps as before.",),
    ),
    Scene(
        start=("A bus sets off with {x} people on it.",),
        state="there are {x} people on the bus",
        question=("How many people are on the bus now?",),
        add=("{x} people get on at the market.", "At the school, {x} children climb aboard."),
        sub=("{x} people get off at the park.", "At the hospital, {x} people step off."),
        mul=(),
    ),
    Scene(
        start=("A garden has {x} tulips.", "{name} plants {x} tulips in the garden."),
        state="the garden has {x} tulips",
        question=("How many tulips are in the garden now?",),
        add=("{name} plants {x} more tulips.", "A neighbour gives {name} {x} tulip bulbs, and all of them bloom."),
        sub=("{name} picks {x} tulips for a bouquet.", "Rabbits eat {x} of the tulips."),
        mul=("By the next spring, the garden has {x} times as many tulips as before.",),
    ),
    Scene(
        start=("{name} starts a game with {x} points.",),
        state="{name}'s score is {x}",
        question=("What is {name}'s score now?", "How many points does {name} have now?"),
        add=("{name} scores {x} points in the next round.", "{name} earns a bonus of {x} points."),
        sub=("{name} loses {x} points for a wrong answer.", "A penalty costs {name} {x} points."),
        mul=("A special card multiplies {name}'s score by {x}.",),
        signed=True,
    ),
    Scene(
        start=("The temperature at dawn is {x} degrees.",),
        state="the temperature is {x} degrees",
        question=("What is the temperature now, in degrees?",),
        add=("By noon, it rises by {x} degrees.", "The afternoon sun warms it by another {x} degrees."),
        sub=("In the evening, it drops by {x} degrees.", "A cold wind lowers it by {x} degrees."),
        signed=True,
    ),
    Scene(
        start=("{name}'s bank account holds {x} dollars.",),
        state="the balance is {x} dollars",
        question=("What is the balance of {name}'s account now, in dollars?",),
        add=("{name} deposits {x} dollars.", "A salary payment of {x} dollars arrives."),
        sub=("{name} pays a bill of {x} dollars.", "{name} withdraws {x} dollars."),
        signed=True,
    ),
)


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


def copy_problem(rng: random.Random, digits: int) -> dict[str, Any]:
    """``"407="`` asks for ``407``: written only in digits and ``=``, the tiny quickstart model's whole
    vocabulary, with GSM8K's answer format; held-out strings are answered only by a policy that copies."""
    text = "".join(rng.choice("0123456789") for _ in range(digits))
    return {"question": f"{text}=", "answer": f"#### {text}", "label": text}


def split(
    make: Callable[[random.Random], dict[str, Any]], rng: random.Random, train_size: int, eval_size: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``eval_size`` then ``train_size`` rows from ``make``; no ``question`` twice anywhere."""
    seen: set[str] = set()

    def draw(n: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        misses = 0
        while len(rows) < n:
            row = make(rng)
            if row["question"] in seen:
                misses += 1
                if misses > 100 * (n + 100):
                    raise ValueError(f"only {len(seen)} distinct questions found: widen the difficulty knobs")
                continue
            seen.add(row["question"])
            rows.append(row)
        return rows

    eval_rows = draw(eval_size)
    return draw(train_size), eval_rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """One JSON object a line, keys in insertion order, ``\\n`` line ends."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _range(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    return parse


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(dict.fromkeys(op.strip() for op in text.split(",")))
    if not ops or not set(ops) <= set(SYMBOLS):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(SYMBOLS)}, got {text!r}")
    return ops


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, write ``train.jsonl`` and ``eval.jsonl`` into ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.tasks.synth", description=__doc__.split("\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    arith = kinds.add_parser("arith", help="GSM8K-format arithmetic word problems")
    countdown = kinds.add_parser("countdown", help="Countdown: reach a target with each number once")
    copy = kinds.add_parser("copy", help='repeat a digit string ("407=" wants 407), for tiny models')
    for sub in (arith, countdown, copy):
        sub.add_argument("--out", type=Path, required=True, help="folder for train.jsonl and eval.jsonl")
        sub.add_argument("--train", type=_range(0, 10**7), required=True, help="train rows")
        sub.add_argument("--eval", type=_range(0, 10**7), required=True, help="eval rows")
        sub.add_argument("--seed", type=int, default=0)
    arith.add_argument("--min-steps", type=_range(1, 4), default=1, help="operations per problem, at least")
    arith.add_argument("--max-steps", type=_range(1, 4), default=2, help="operations per problem, at most")
    arith.add_argument("--min-digits", type=_range(1, 6), default=1, help="digits of every number, at least")
    arith.add_argument("--max-digits", type=_range(1, 6), default=2, help="digits of every number, at most")
    arith.add_argument("--ops", type=_ops, default=("add", "sub", "mul"), help="comma-separated: add,sub,mul")
    arith.add_argument(
        "--style",
        choices=("story", "bare"),
        default="story",
        help='a word problem, or the bare expression ("What is 12 + 5?")',
    )
    arith.add_argument(
        "--allow-negative",
        action="store_true",
        help="let values drop below zero (only in stories where that makes sense)",
    )
    copy.add_argument("--digits", type=_range(1, 12), default=3, help="length of every string")
    countdown.add_argument("--count", type=_range(3, 4), default=3, help="numbers per problem")
    countdown.add_argument("--min-number", type=_range(1, 10**6), default=1)
    countdown.add_argument("--max-number", type=_range(1, 10**6), default=99)
    countdown.add_argument("--max-target", type=_range(1, 10**9), default=100)
    args = parser.parse_args(argv)

    if args.kind == "arith":
        if args.min_steps > args.max_steps or args.min_digits > args.max_digits:
            parser.error("--min-steps/--min-digits must not exceed --max-steps/--max-digits")

        def make(rng: random.Random) -> dict[str, Any]:
            return arith_problem(
                rng, args.min_steps, args.max_steps, args.min_digits, args.max_digits, args.ops, args.allow_negative
            ).row(args.style)
    elif args.kind == "copy":

        def make(rng: random.Random) -> dict[str, Any]:
            return copy_problem(rng, args.digits)
    else:
        if args.min_number > args.max_number:
            parser.error("--min-number must not exceed --max-number")

        def make(rng: random.Random) -> dict[str, Any]:
            return countdown_problem(rng, args.count, args.min_number, args.max_number, args.max_target).row()

    try:
        train_rows, eval_rows = split(make, random.Random(args.seed), args.train, args.eval)
    except ValueError as exc:  # knobs that admit too few problems
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        write_jsonl(args.out / f"{name}.jsonl", rows)
        print(f"wrote {args.out / f'{name}.jsonl'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
