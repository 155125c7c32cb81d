"""Synthetic verifiable datasets: GSM8K-style arithmetic, multiplication and division, and Countdown.

    python -m asyncrl.tasks.synth arith --out data/arith --train 2000 --eval 200 --seed 0
    python -m asyncrl.tasks.synth muldiv --out data/muldiv --train 2000 --eval 200 --seed 0
    python -m asyncrl.tasks.synth countdown --out data/countdown --train 1000 --eval 100 --seed 0

writes ``DIR/train.jsonl`` and ``DIR/eval.jsonl``. The output is a function
of the arguments alone (one ``random.Random(seed)``; ``json.dumps`` in a
fixed key order), so a command regenerates its files byte for byte. The
eval rows are drawn first, then the train rows, skipping any question
already drawn: no question appears twice, within a split or across them,
and the eval split stays the same when only ``--train`` changes.

Each row is built from a structured problem (``ArithProblem``,
``MulDivProblem``, ``CountdownProblem``) whose answer is computed from its
numbers, never read back from text; the tests recompute it from the same
structure.
"""

from asyncrl.tasks.synth.arith import APPLY, SYMBOLS, ArithProblem, arith_problem
from asyncrl.tasks.synth.cli import copy_problem, main, split, write_jsonl
from asyncrl.tasks.synth.countdown import CountdownProblem, countdown_problem
from asyncrl.tasks.synth.muldiv import GROUP_SCENES, MULDIV_KINDS, GroupScene, MulDivProblem, muldiv_problem
from asyncrl.tasks.synth.scenes import NAMES, SCENES, Scene

__all__ = [
    "APPLY",
    "GROUP_SCENES",
    "MULDIV_KINDS",
    "NAMES",
    "SCENES",
    "SYMBOLS",
    "ArithProblem",
    "CountdownProblem",
    "GroupScene",
    "MulDivProblem",
    "Scene",
    "arith_problem",
    "copy_problem",
    "countdown_problem",
    "main",
    "muldiv_problem",
    "split",
    "write_jsonl",
]
