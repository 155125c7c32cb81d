"""The stories arithmetic problems are told in: names, and one :class:`Scene` per setting.

Data only; :mod:`asyncrl.tasks.synth.arith` draws from it. Appending a scene
or a sentence changes which problems a seed draws (the draw indexes these
tuples), so ``data/`` would have to be regenerated (``data/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
