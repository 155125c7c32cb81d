"""Word problems on multiplying and dividing 2-3 digit numbers, each division exact by construction.

Every problem is a story of equal groups: ``groups`` crates of ``each`` eggs
make ``groups * each`` eggs. A multiplication asks for that total. A division
states the total and asks for one of the two factors, so its dividend is a
product and its answer an integer. A two-step problem multiplies and then
divides the total by a ``divisor`` built from the factors' own divisors, so
that division is exact too. The factors and the divisor have ``min_digits``
to ``max_digits`` digits; a dividend, being a product, may have more.

The answer is computed from the problem's numbers, never read back from
text. Appending a scene or a sentence changes which problems a seed draws,
as in :mod:`asyncrl.tasks.synth.scenes`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.synth.scenes import NAMES

MULDIV_KINDS = ("mul", "div", "two-step")


@dataclass(frozen=True)
class GroupScene:
    """One setting of equal groups, with the sentences that tell each kind of problem in it.

    Sentences take ``{name}``, ``{groups}``, ``{each}``, ``{total}`` and
    ``{divisor}``. ``made`` states the groups and their size; a multiplication
    follows it with a ``total_question`` and a two-step problem with a
    ``regrouped`` sentence and its question. ``shared`` (a total split over
    ``{groups}``) and ``packed`` (a total split ``{each}`` at a time) are whole
    division problems. The ``*_state`` clauses are the worked solution's
    lines, where ``{x}`` becomes ``128 * 36 = <<128*36=4608>>4608``.
    """

    made: tuple[str, ...]
    total_question: tuple[str, ...]
    total_state: str
    shared: tuple[str, ...]
    each_state: str
    packed: tuple[str, ...]
    groups_state: str
    regrouped: tuple[str, ...]
    regrouped_state: str


GROUP_SCENES = (
    GroupScene(
        made=(
            "A farm packs {groups} crates with {each} eggs in each crate.",
            "{name} fills {groups} crates with {each} eggs each.",
        ),
        total_question=("How many eggs are packed in all?", "How many eggs is that altogether?"),
        total_state="there are {x} eggs",
        shared=(
            "A farm shares {total} eggs equally among {groups} crates. How many eggs go in each crate?",
            "{name} spreads {total} eggs evenly over {groups} crates. How many eggs are in each crate?",
        ),
        each_state="each crate holds {x} eggs",
        packed=(
            "A farm packs {total} eggs into crates of {each}. How many crates does it fill?",
            "{name} has {total} eggs and puts {each} in every crate. How many crates are filled?",
        ),
        groups_state="{x} crates are filled",
        regrouped=("All the eggs are then repacked into cartons of {divisor}. How many cartons are filled?",),
        regrouped_state="{x} cartons are filled",
    ),
    GroupScene(
        made=(
            "A library has {groups} shelves with {each} books on each shelf.",
            "{name} arranges books on {groups} shelves, {each} books to a shelf.",
        ),
        total_question=("How many books are on the shelves?", "How many books is that altogether?"),
        total_state="there are {x} books",
        shared=(
            "{total} books are shared equally among {groups} shelves. How many books go on each shelf?",
            "A library puts {total} books on {groups} shelves, the same number on each. "
            "How many books are on each shelf?",
        ),
        each_state="each shelf holds {x} books",
        packed=(
            "{name} puts {total} books on shelves, {each} books to a shelf. How many shelves does {name} fill?",
            "A library has {total} books, and each shelf holds {each}. How many shelves are needed?",
        ),
        groups_state="the books fill {x} shelves",
        regrouped=(
            "The books are then shared equally among {divisor} classrooms. How many books does each classroom get?",
        ),
        regrouped_state="each classroom gets {x} books",
    ),
    GroupScene(
        made=(
            "A stadium has {groups} rows with {each} seats in each row.",
            "A concert hall sets out {groups} rows of {each} seats.",
        ),
        total_question=("How many seats are there in all?",),
        total_state="there are {x} seats",
        shared=("A stadium has {total} seats in {groups} equal rows. How many seats are in each row?",),
        each_state="each row has {x} seats",
        packed=("A stadium has {total} seats, with {each} seats in every row. How many rows are there?",),
        groups_state="there are {x} rows",
        regrouped=("The seats are divided into {divisor} equal sections. How many seats are in each section?",),
        regrouped_state="each section has {x} seats",
    ),
    GroupScene(
        made=(
            "A factory fills {groups} cases with {each} bottles each.",
            "{name} loads {groups} cases onto a truck, and each case holds {each} bottles.",
        ),
        total_question=("How many bottles are there?", "How many bottles is that in total?"),
        total_state="there are {x} bottles",
        shared=("A factory packs {total} bottles equally into {groups} cases. How many bottles go in each case?",),
        each_state="each case holds {x} bottles",
        packed=("A factory fills {total} bottles and packs them {each} to a case. How many cases does it pack?",),
        groups_state="{x} cases are packed",
        regrouped=("The bottles are shipped equally to {divisor} stores. How many bottles does each store get?",),
        regrouped_state="each store gets {x} bottles",
    ),
    GroupScene(
        made=(
            "{name} works {groups} days and earns ${each} each day.",
            "{name} earns ${each} a day and works {groups} days.",
        ),
        total_question=("How many dollars does {name} earn?", "How much does {name} earn in total, in dollars?"),
        total_state="{name} earns {x} dollars",
        shared=(
            "{name} earns ${total} for {groups} days of work, the same amount every day. "
            "How many dollars does {name} earn per day?",
        ),
        each_state="{name} earns {x} dollars a day",
        packed=("{name} earns ${each} a day. How many days must {name} work to earn ${total}?",),
        groups_state="{name} must work {x} days",
        regrouped=("{name} gives all of it equally to {divisor} charities. How many dollars does each charity get?",),
        regrouped_state="each charity gets {x} dollars",
    ),
    GroupScene(
        made=("{name} reads {each} pages every day for {groups} days.",),
        total_question=("How many pages does {name} read in all?",),
        total_state="{name} reads {x} pages",
        shared=(
            "{name} reads a {total}-page book in {groups} days, the same number of pages each day. "
            "How many pages does {name} read each day?",
        ),
        each_state="{name} reads {x} pages a day",
        packed=("{name} reads {each} pages a day. How many days does it take {name} to read {total} pages?",),
        groups_state="it takes {x} days",
        regrouped=(
            "Together those pages make up {divisor} chapters of equal length. How many pages long is each chapter?",
        ),
        regrouped_state="each chapter is {x} pages long",
    ),
    GroupScene(
        made=("A festival runs {groups} buses, each carrying {each} visitors.",),
        total_question=("How many visitors do the buses carry?",),
        total_state="the buses carry {x} visitors",
        shared=(
            "{total} visitors ride to a festival on {groups} equally full buses. How many visitors are on each bus?",
        ),
        each_state="each bus carries {x} visitors",
        packed=("{total} visitors ride to a festival, {each} on each bus. How many buses are needed?",),
        groups_state="{x} buses are needed",
        regrouped=(
            "At the festival, the visitors split into tour groups of {divisor}. How many tour groups are there?",
        ),
        regrouped_state="there are {x} tour groups",
    ),
    GroupScene(
        made=(
            "An orchard has {groups} trees, and each tree gives {each} apples.",
            "{name} picks {each} apples from each of {groups} trees.",
        ),
        total_question=("How many apples is that altogether?", "How many apples are there in all?"),
        total_state="there are {x} apples",
        shared=(
            "{name} picks {total} apples from {groups} trees, the same number from each tree. "
            "How many apples come from each tree?",
        ),
        each_state="each tree gives {x} apples",
        packed=("{name} picks {total} apples, {each} from each tree. How many trees does {name} pick from?",),
        groups_state="{name} picks from {x} trees",
        regrouped=("The apples are packed in bags of {divisor}. How many bags are filled?",),
        regrouped_state="{x} bags are filled",
    ),
    GroupScene(
        made=("{name} makes {groups} necklaces with {each} beads on each necklace.",),
        total_question=("How many beads does {name} use?",),
        total_state="{name} uses {x} beads",
        shared=(
            "{name} threads {total} beads onto {groups} necklaces, the same number on each. "
            "How many beads are on each necklace?",
        ),
        each_state="each necklace has {x} beads",
        packed=("{name} has {total} beads and puts {each} on each necklace. How many necklaces can {name} make?",),
        groups_state="{name} makes {x} necklaces",
        regrouped=("{name} bought the beads in packets of {divisor}. How many packets did {name} buy?",),
        regrouped_state="{name} bought {x} packets",
    ),
    GroupScene(
        made=("A hall's floor is covered with {groups} rows of {each} tiles.",),
        total_question=("How many tiles cover the floor?",),
        total_state="{x} tiles cover the floor",
        shared=("{total} tiles cover a floor in {groups} equal rows. How many tiles are in each row?",),
        each_state="each row has {x} tiles",
        packed=("{total} tiles cover a floor, {each} tiles to a row. How many rows are there?",),
        groups_state="there are {x} rows",
        regrouped=("The tiles came in boxes of {divisor}. How many boxes were used?",),
        regrouped_state="{x} boxes were used",
    ),
)


@dataclass(frozen=True)
class MulDivProblem:
    """``groups`` equal groups of ``each`` things in one scene, and which number the question asks for.

    ``asks`` is ``"total"`` (``groups * each``), ``"each"`` (the total over
    ``groups``), ``"groups"`` (the total over ``each``) or ``"regrouped"``
    (the total over ``divisor``, a two-step problem). ``divisor`` is 0 unless
    the problem is two-step.
    """

    scene: int  # index into GROUP_SCENES
    name: str
    asks: str
    groups: int
    each: int
    divisor: int
    phrasing: tuple[int, ...]  # which sentences: made's and the question's, or the division's one

    @property
    def kind(self) -> str:
        """``"mul"``, ``"div"`` or ``"two-step"``: the ``--kinds`` value that draws this problem."""
        return {"total": "mul", "each": "div", "groups": "div", "regrouped": "two-step"}[self.asks]

    @property
    def total(self) -> int:
        """The number of things in all: the product, and every division's dividend."""
        return self.groups * self.each

    def answer(self) -> int:
        """The number the question asks for; every division here leaves no remainder."""
        if self.asks == "total":
            return self.total
        return self.total // {"each": self.groups, "groups": self.each, "regrouped": self.divisor}[self.asks]

    def templates(self) -> tuple[str, ...]:
        """The scene's sentences that tell this problem, in order, before the numbers are filled in."""
        scene, pick = GROUP_SCENES[self.scene], self.phrasing
        if self.asks == "each":
            return (scene.shared[pick[0]],)
        if self.asks == "groups":
            return (scene.packed[pick[0]],)
        follow = scene.total_question if self.asks == "total" else scene.regrouped
        return (scene.made[pick[0]], follow[pick[1]])

    def row(self) -> dict[str, Any]:
        """``question``, a GSM8K ``answer`` (worked lines, then ``#### N``) and ``label``."""
        scene = GROUP_SCENES[self.scene]
        names = dict(name=self.name, groups=self.groups, each=self.each, total=self.total, divisor=self.divisor)
        question = " ".join(sentence.format(**names) for sentence in self.templates())
        if self.asks == "each":
            lines = [self._line(scene.each_state, self.total, "/", self.groups, self.each)]
        elif self.asks == "groups":
            lines = [self._line(scene.groups_state, self.total, "/", self.each, self.groups)]
        else:
            lines = [self._line(scene.total_state, self.groups, "*", self.each, self.total)]
            if self.asks == "regrouped":
                lines.append(self._line(scene.regrouped_state, self.total, "/", self.divisor, self.answer()))
        label = str(self.answer())
        return {"question": question, "answer": "\n".join(lines) + f"\n#### {label}", "label": label}

    def _line(self, state: str, left: int, symbol: str, right: int, result: int) -> str:
        work = f"{left} {symbol} {right} = <<{left}{symbol}{right}={result}>>{result}"
        text = state.format(name=self.name, x=work)
        return text[:1].upper() + text[1:] + "."


def muldiv_problem(
    rng: random.Random, min_digits: int = 2, max_digits: int = 3, kinds: Sequence[str] = MULDIV_KINDS
) -> MulDivProblem:
    """A random problem whose factors (and divisor) have ``min_digits`` to ``max_digits`` digits.

    The kind is drawn uniformly from ``kinds``, and a division asks for
    either factor with equal chance. A two-step draw whose product has no
    divisor of the right size (other than the factors themselves, and with a
    quotient of at least 2) is drawn again.
    """
    for _ in range(1000):
        scene_index = rng.randrange(len(GROUP_SCENES))
        scene = GROUP_SCENES[scene_index]
        kind = rng.choice(list(kinds))
        groups, each = _number(rng, min_digits, max_digits), _number(rng, min_digits, max_digits)
        divisor = 0
        if kind == "mul":
            asks, phrasing = "total", (rng.randrange(len(scene.made)), rng.randrange(len(scene.total_question)))
        elif kind == "div":
            asks = rng.choice(("each", "groups"))
            phrasing = (rng.randrange(len(scene.shared if asks == "each" else scene.packed)),)
        else:
            divisors = _divisors(groups, each, min_digits, max_digits)
            if not divisors:
                continue
            asks, divisor = "regrouped", rng.choice(divisors)
            phrasing = (rng.randrange(len(scene.made)), rng.randrange(len(scene.regrouped)))
        return MulDivProblem(scene_index, rng.choice(NAMES), asks, groups, each, divisor, phrasing)
    raise ValueError(f"no problem found with kinds={list(kinds)}, digits {min_digits}-{max_digits}: allow more digits")


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """A number of ``min_digits`` to ``max_digits`` digits (each count equally likely), at least 2."""
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(max(2, 10 ** (digits - 1)), 10**digits - 1)


def _divisors(groups: int, each: int, min_digits: int, max_digits: int) -> list[int]:
    """Divisors of ``groups * each`` with the allowed digits, neither factor, leaving a quotient of 2 or more.

    Each is a divisor of ``groups`` times a divisor of ``each``, so it
    divides the product; sorted, so a seed picks the same one every time.
    """
    total = groups * each
    found = {a * b for a in _factors(groups) for b in _factors(each)}
    return sorted(
        d
        for d in found
        if min_digits <= len(str(d)) <= max_digits and d >= 2 and d not in (groups, each) and total // d >= 2
    )


def _factors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in small]
