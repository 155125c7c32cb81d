"""Rank 0's held-out evaluations: which versions to evaluate, what finished, and the summary's numbers.

Generators run the evaluations while training goes on (:class:`~asyncrl.control.evaluation.EvalBook`
hands them out); the learner only decides which version is due and writes what comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import EvalConfig
from asyncrl.control.evaluation import EvalBook, write_result
from asyncrl.observe.metrics import MetricsWriter, in_step_order

log = logging.getLogger(__name__)


def eval_summary(results: list[dict], k: int) -> dict:
    """``summary.json``'s ``eval``: pass@1 and pass@k at the start, at their best and at the end, by step."""
    if not results:
        return {}
    results = in_step_order(results)
    ones = [r["pass@1"] for r in results]
    ks = [r[f"pass@{k}"] for r in results]
    return {
        "pass@1_start": ones[0],
        "pass@1_best": max(ones),
        "pass@1_final": ones[-1],
        f"pass@{k}_start": ks[0],
        f"pass@{k}_best": max(ks),
        f"pass@{k}_final": ks[-1],
        "evaluations": len(results),
        "prompts": results[-1]["prompts"],
    }


class Evaluations:
    """Schedules evaluations by step and version and writes their results; a ``book`` of None evaluates nothing.

    An evaluation falls due at a step and evaluates the first version published from then on.
    """

    def __init__(
        self,
        book: EvalBook | None,
        config: EvalConfig,
        run_dir: Path,
        metrics: MetricsWriter,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.book, self.config, self.run_dir, self.metrics = book, config, run_dir, metrics
        self._clock, self._sleep = clock, sleep
        self.results: list[dict] = []  # eval.jsonl's records, a resumed run's earlier ones included
        self._owed = False

    def start(self, version: int, step: int) -> None:
        """Evaluate the starting policy, for comparison."""
        if self.book is not None:
            self._schedule(version, step, budgeted=False)  # in full: the generators hold these weights now

    def _schedule(self, version: int, step: int, budgeted: bool = True) -> None:
        for skipped in self.book.schedule(version, step, budgeted):
            log.info(
                "eval of v%d skipped for v%d: eval.max_share left it no tokens yet (evaluation is %d tokens ahead "
                "of its share)",
                skipped,
                version,
                self.book.owed(),
            )

    def stepped(self, step: int) -> None:
        """Note that ``step`` was taken: an evaluation due now waits for the next version."""
        self._owed = self._owed or (self.book is not None and self.book.due(step))

    def published(self, version: int, step: int) -> None:
        """Evaluate ``version``, just published at ``step``, if an evaluation is owed."""
        if self._owed:
            self._schedule(version, step)
            self._owed = False

    def unfinished(self, step: int) -> list[tuple[int, int]]:
        """What a checkpoint at ``step`` keeps: the evaluations still out, and one owed to the next version."""
        if self.book is None:
            return []
        return self.book.open() + ([(-1, step)] if self._owed else [])

    def resume(self, unfinished: list[tuple[int, int]], version: int) -> None:
        """Schedule again what :meth:`unfinished` kept of ``version``, the resumed one (which the learner
        publishes as it starts), where no result holds it: the run stopped before it was answered. One owed
        evaluates it too. An older version's is not: generators answer with the weights they hold."""
        if self.book is None:
            return
        done = {r["version"] for r in self.results}
        for evaluated, step in unfinished:
            evaluated = version if evaluated < 0 else evaluated
            if evaluated == version and evaluated not in done:
                self._schedule(evaluated, step, budgeted=False)
            elif evaluated not in done:
                log.warning("the eval of v%d was not finished before the run stopped; its weights are gone", evaluated)

    def collect(self) -> None:
        """Rank 0's main thread: write finished evaluations (traces, scores, TensorBoard)."""
        if self.book is None:
            return
        for result in self.book.finished():
            write_result(self.run_dir, result)
            scores = {"eval/pass@1": result.pass_at_1, f"eval/pass@{result.k}": result.pass_at_k}
            self.metrics.scalars(scores, result.step)
            self.results.append(result.record())
            answered = result.versions
            by = "" if answered == [result.version] else f" (answered by v{answered[0]}-v{answered[-1]})"
            log.info(
                "eval of v%d (step %d): pass@1 %.3f, pass@%d %.3f on %d prompts%s",
                result.version,
                result.step,
                result.pass_at_1,
                result.k,
                result.pass_at_k,
                result.num_prompts,
                by,
            )

    def final(self, version: int, step: int, meanwhile: Callable[[], None]) -> None:
        """Evaluate the last version (unless it was already) and wait for what is still out, within
        ``eval.final_timeout_s``; ``meanwhile`` runs every 0.2 s of the wait (the status snapshot)."""
        if self.book is None:
            return
        self.book.lift_budget()
        if version not in {r["version"] for r in self.results}:  # before a resume, perhaps
            self._schedule(version, step)
        deadline = self._clock() + self.config.final_timeout_s
        while self.book.pending() and self._clock() < deadline:
            self._sleep(0.2)
            meanwhile()
        if self.book.pending():
            log.warning("%d evaluations unfinished after eval.final_timeout_s", self.book.pending())
        self.collect()

    def summary(self) -> dict:
        """``summary.json``'s ``eval`` (:func:`eval_summary`), with evaluation's share of the tokens generated
        (``token_share``, which ``eval.max_share`` bounds) and of the sequences (``sequence_share``)."""
        out = eval_summary(self.results, self.config.k)
        if not out or self.book is None:
            return out
        shares = {"token_share": self.book.token_share(), "sequence_share": self.book.share()}
        return {**out, **{k: v for k, v in shares.items() if v is not None}}
