"""Held-out evaluation while training runs: the learner schedules it, generators do it.

When the learner publishes a version due for evaluation, it splits the
held-out prompts into pieces (:class:`~asyncrl.wire.protocol.EvalTicket`). The
coordinator hands a piece to a generator that holds the latest weights,
alongside its training tickets; the generator answers each prompt greedily
(pass@1) and with ``k`` samples (pass@k), scores them with the task's
reward and reports every trace (:class:`~asyncrl.wire.protocol.EvalReport`).
Training never waits for it.

With ``eval.max_share`` the book keeps evaluation to that share of the
sequences generated: the coordinator tells it what training was handed out
(:meth:`EvalBook.trained`), which earns evaluation sequences at ``share / (1 -
share)`` of it, and a piece goes out only while some are left. Evaluations
then lag behind training, so a scheduled one that has not begun gives way to
the next (:meth:`EvalBook.schedule` returns the versions it skipped). The
starting policy's evaluation (``budgeted=False``) and the final one
(:meth:`EvalBook.lift_budget`) run without a budget.

A piece not reported within ``reissue_after_s`` goes to another generator
(the book's ``clock`` times it, so a test moves a fake one instead of
waiting); the first report of a piece counts. Each trace records the weights
that answered it: a generator that moved on to a newer version before taking
a piece evaluates with those, and the result says so (``versions``).

The coordinator's thread calls :meth:`EvalBook.next_piece` and
:meth:`EvalBook.report`; the learner's main thread calls
:meth:`EvalBook.schedule` and :meth:`EvalBook.finished`. All state is behind
one lock, and a finished evaluation is handed over whole.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from asyncrl.config import EvalConfig
from asyncrl.wire.protocol import EvalReport, EvalTicket, EvalTrace


@dataclass
class _Eval:
    version: int
    step: int
    pieces: dict[int, list[int]]  # piece number -> indices
    issued: dict[int, float] = field(default_factory=dict)  # piece -> clock time it was handed out
    traces: dict[int, list[EvalTrace]] = field(default_factory=dict)  # piece -> its report's traces
    budgeted: bool = True  # under eval.max_share: false for the starting policy's, which runs in full


@dataclass(frozen=True)
class EvalResult:
    """One finished evaluation: its scores and every trace."""

    version: int
    step: int
    pass_at_1: float
    pass_at_k: float
    k: int
    num_prompts: int
    versions: list[int]
    traces: list[EvalTrace]

    def record(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "pass@1": self.pass_at_1,
            f"pass@{self.k}": self.pass_at_k,
            "prompts": self.num_prompts,
            "versions": self.versions,
            "reward_failures": sum(t.reward_failed for t in self.traces),
        }


def score(traces: list[EvalTrace], k: int, threshold: float) -> tuple[float, float, int]:
    """``(pass@1, pass@k, prompts)``: a prompt passes when a response's reward reaches ``threshold``.

    pass@1 is the greedy response's; pass@k counts a prompt when any of its
    ``k`` sampled responses passes (the unbiased estimator of Chen et al.
    2021 with n = k).
    """
    by_prompt: dict[int, list[EvalTrace]] = {}
    for trace in traces:
        by_prompt.setdefault(trace.index, []).append(trace)
    n = len(by_prompt)
    if n == 0:
        return 0.0, 0.0, 0
    greedy = sum(any(t.greedy and t.reward >= threshold for t in ts) for ts in by_prompt.values())
    sampled = sum(any(not t.greedy and t.reward >= threshold for t in ts) for ts in by_prompt.values())
    return greedy / n, sampled / n, n


def earned_per_training(max_share: float) -> float | None:
    """Evaluation sequences one training sequence earns under ``eval.max_share`` (evaluation then holds that
    share of all sequences); None: no budget."""
    return max_share / (1 - max_share) if max_share > 0 else None


class EvalBook:
    """Evaluations scheduled, pieces out, reports in."""

    def __init__(
        self,
        config: EvalConfig,
        num_items: int,
        max_new_tokens: int,
        threshold: float,
        reissue_after_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.indices = list(range(min(num_items, config.max_items or num_items)))
        self.max_new_tokens = max_new_tokens
        self.threshold = threshold
        self.reissue_after_s = reissue_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, _Eval] = {}
        self._done: list[EvalResult] = []
        self._scheduled: set[int] = set()  # every version ever scheduled, open or done
        self._earn = earned_per_training(config.max_share)
        self._piece_cost = config.items_per_request * (config.k + 1)
        self._credit = 0.0  # evaluation sequences earned and not yet spent (a piece may overdraw it)
        self._handed_out = {"training": 0, "eval": 0}  # sequences

    def scheduled(self, version: int) -> bool:
        """Whether ``version`` was ever scheduled (it is evaluated once, however often it is scheduled)."""
        with self._lock:
            return version in self._scheduled

    def due(self, step: int) -> bool:
        every = self.config.every_steps
        return bool(every) and bool(self.indices) and step % every == 0

    def schedule(self, version: int, step: int, budgeted: bool = True) -> list[int]:
        """Evaluate ``version`` (published at ``step``). An older evaluation still runs, except under a budget
        one that has not begun, which is skipped: the versions skipped. ``budgeted`` false: outside
        ``eval.max_share`` (the starting policy, evaluated in full before its weights move on)."""
        size = self.config.items_per_request
        pieces = {i: self.indices[start : start + size] for i, start in enumerate(range(0, len(self.indices), size))}
        with self._lock:
            if version in self._scheduled:
                return []
            skipped = [v for v, ev in self._open.items() if self._earn is not None and ev.budgeted and not ev.issued]
            for v in skipped:
                del self._open[v]
            self._scheduled.add(version)
            self._open[version] = _Eval(version, step, pieces, budgeted=budgeted)
            return skipped

    def trained(self, sequences: int) -> None:
        """The coordinator handed out ``sequences`` training sequences: under a budget, they earn evaluation
        its share (kept to one piece's worth while nothing waits to be evaluated)."""
        with self._lock:
            self._handed_out["training"] += sequences
            if self._earn is None:
                return
            self._credit += sequences * self._earn
            if not self._open:
                self._credit = min(self._credit, self._piece_cost)

    def share(self) -> float | None:
        """Evaluation's share of the sequences handed out so far (pieces reissued count again); None before
        any."""
        with self._lock:
            total = sum(self._handed_out.values())
            return self._handed_out["eval"] / total if total else None

    def lift_budget(self) -> None:
        """Training is over: what is left to evaluate goes out at once."""
        with self._lock:
            self._earn = None

    def next_piece(self, generator_version: int) -> EvalTicket | None:
        """A piece for a generator holding ``generator_version``: the oldest evaluation first."""
        now = self._clock()
        with self._lock:
            for ev in sorted(self._open.values(), key=lambda e: e.version):
                charged = self._earn is not None and ev.budgeted
                if ev.version > generator_version or (charged and self._credit <= 0):
                    continue
                for number, indices in ev.pieces.items():
                    if number in ev.traces:
                        continue
                    if now - ev.issued.get(number, -1e18) < self.reissue_after_s:
                        continue
                    ev.issued[number] = now
                    cost = len(indices) * (self.config.k + 1)  # a greedy answer and k samples per prompt
                    self._handed_out["eval"] += cost
                    if charged:
                        self._credit -= cost
                    return EvalTicket(
                        version=ev.version,
                        indices=indices,
                        k=self.config.k,
                        temperature=self.config.temperature,
                        max_new_tokens=self.max_new_tokens,
                    )
        return None

    def report(self, report: EvalReport) -> None:
        """Take a generator's traces; the first report of a piece counts, later ones are ignored."""
        with self._lock:
            ev = self._open.get(report.version)
            if ev is None:
                return
            for number, indices in ev.pieces.items():
                if indices == report.indices and number not in ev.traces:
                    ev.traces[number] = list(report.traces)
                    break
            if len(ev.traces) == len(ev.pieces):
                del self._open[report.version]
                traces = [t for number in sorted(ev.traces) for t in ev.traces[number]]
                pass1, passk, n = score(traces, self.config.k, self.threshold)
                self._done.append(
                    EvalResult(
                        ev.version, ev.step, pass1, passk, self.config.k, n, sorted({t.version for t in traces}), traces
                    )
                )

    def finished(self) -> list[EvalResult]:
        """Evaluations completed since the last call, oldest first."""
        with self._lock:
            out, self._done = self._done, []
        return sorted(out, key=lambda r: r.version)

    def pending(self) -> int:
        with self._lock:
            return len(self._open)


def write_result(run_dir: Path, result: EvalResult) -> None:
    """``eval/vNNNNNN.jsonl`` (every trace) and a line in ``eval.jsonl`` (the scores)."""
    folder = run_dir / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"v{result.version:06d}.jsonl", "w") as f:
        for trace in result.traces:
            f.write(json.dumps(msgspec.to_builtins(trace)) + "\n")
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps(result.record()) + "\n")


def read_results(run_dir: Path) -> list[dict]:
    """The score records :func:`write_result` appended to ``run_dir/eval.jsonl``, in the order written;
    empty if there is none yet."""
    path = Path(run_dir) / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
