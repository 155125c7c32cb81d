"""``python -m asyncrl.tasks.synth``: draw the rows of a synthetic dataset and write its two splits."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.tasks.synth.arith import SYMBOLS, arith_problem
from asyncrl.tasks.synth.countdown import countdown_problem
from asyncrl.tasks.synth.muldiv import MULDIV_KINDS, muldiv_problem


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


def _subset(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(dict.fromkeys(item.strip() for item in text.split(",")))
        if not chosen or not set(chosen) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return chosen

    return parse


DESCRIPTION = "Synthetic verifiable datasets: GSM8K-style arithmetic, multiplication and division, and Countdown."


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per kind of dataset, with its difficulty knobs."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.tasks.synth", description=DESCRIPTION)
    kinds = parser.add_subparsers(dest="kind", required=True)
    arith = kinds.add_parser("arith", help="GSM8K-format arithmetic word problems")
    countdown = kinds.add_parser("countdown", help="Countdown: reach a target with each number once")
    copy = kinds.add_parser("copy", help='repeat a digit string ("407=" wants 407), for tiny models')
    muldiv = kinds.add_parser("muldiv", help="GSM8K-format word problems that multiply or exactly divide")
    for sub in (arith, countdown, copy, muldiv):
        sub.add_argument("--out", type=Path, required=True, help="folder for train.jsonl and eval.jsonl")
        sub.add_argument("--train", type=_range(0, 10**7), required=True, help="train rows")
        sub.add_argument("--eval", type=_range(0, 10**7), required=True, help="eval rows")
        sub.add_argument("--seed", type=int, default=0)
    arith.add_argument("--min-steps", type=_range(1, 4), default=1, help="operations per problem, at least")
    arith.add_argument("--max-steps", type=_range(1, 4), default=2, help="operations per problem, at most")
    arith.add_argument("--min-digits", type=_range(1, 6), default=1, help="digits of every number, at least")
    arith.add_argument("--max-digits", type=_range(1, 6), default=2, help="digits of every number, at most")
    arith.add_argument(
        "--ops", type=_subset(tuple(SYMBOLS)), default=("add", "sub", "mul"), help="comma-separated: add,sub,mul"
    )
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
    muldiv.add_argument("--min-digits", type=_range(1, 4), default=2, help="digits of every factor, at least")
    muldiv.add_argument("--max-digits", type=_range(1, 4), default=3, help="digits of every factor, at most")
    muldiv.add_argument(
        "--kinds",
        type=_subset(MULDIV_KINDS),
        default=MULDIV_KINDS,
        help="comma-separated: mul,div,two-step (multiply, then divide)",
    )
    countdown.add_argument("--count", type=_range(3, 4), default=3, help="numbers per problem")
    countdown.add_argument("--min-number", type=_range(1, 10**6), default=1)
    countdown.add_argument("--max-number", type=_range(1, 10**6), default=99)
    countdown.add_argument("--max-target", type=_range(1, 10**9), default=100)
    return parser


def _maker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Callable[[random.Random], dict[str, Any]]:
    """What draws one row of the dataset ``args`` asks for; knobs that contradict each other end the program."""
    if args.kind == "arith":
        if args.min_steps > args.max_steps or args.min_digits > args.max_digits:
            parser.error("--min-steps/--min-digits must not exceed --max-steps/--max-digits")

        def make(rng: random.Random) -> dict[str, Any]:
            return arith_problem(
                rng, args.min_steps, args.max_steps, args.min_digits, args.max_digits, args.ops, args.allow_negative
            ).row(args.style)
    elif args.kind == "muldiv":
        if args.min_digits > args.max_digits:
            parser.error("--min-digits must not exceed --max-digits")

        def make(rng: random.Random) -> dict[str, Any]:
            return muldiv_problem(rng, args.min_digits, args.max_digits, args.kinds).row()
    elif args.kind == "copy":

        def make(rng: random.Random) -> dict[str, Any]:
            return copy_problem(rng, args.digits)
    else:
        if args.min_number > args.max_number:
            parser.error("--min-number must not exceed --max-number")

        def make(rng: random.Random) -> dict[str, Any]:
            return countdown_problem(rng, args.count, args.min_number, args.max_number, args.max_target).row()

    return make


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, write ``train.jsonl`` and ``eval.jsonl`` into ``--out``."""
    parser = _parser()
    args = parser.parse_args(argv)
    make = _maker(args, parser)
    try:
        train_rows, eval_rows = split(make, random.Random(args.seed), args.train, args.eval)
    except ValueError as exc:  # knobs that admit too few problems
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        write_jsonl(args.out / f"{name}.jsonl", rows)
        print(f"wrote {args.out / f'{name}.jsonl'}: {len(rows)} rows")
