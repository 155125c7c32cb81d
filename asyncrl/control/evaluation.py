"""Held-out evaluation while training runs: the learner schedules it, generators do it.

When the learner publishes a version due for evaluation, it splits the
held-out prompts into pieces (:class:`~asyncrl.wire.protocol.EvalTicket`). The
coordinator hands a piece to a generator that holds the latest weights,
alongside its training tickets; the generator answers each prompt greedily
(pass@1) and with ``k`` samples (pass@k), scores them with the task's
reward and reports every trace (:class:`~asyncrl.wire.protocol.EvalReport`).
Training never waits for it.

With ``eval.max_share`` the book keeps evaluation to that share of the
tokens generated, the unit a generator's time goes by (an early evaluation's
answers may run four times as long as the training answers of later steps).
The coordinator passes on the training samples and tokens generators report
(:meth:`EvalBook.generated`), which earn evaluation tokens at ``share / (1 -
share)`` of them, and a piece goes out only while some are left. A piece is
charged an estimate when it goes out (its sequences at the mean length of
the latest piece's answers, else of training's) and what its answers took
once reported. Evaluations then lag behind training, so a scheduled one that
has not begun gives way to the next (:meth:`EvalBook.schedule` returns the
versions it skipped). The starting policy's evaluation (``budgeted=False``)
goes out in full at once, before its weights move on, and is charged like
any other: the evaluations after it wait until training has earned what it
took. The final one (:meth:`EvalBook.lift_budget`) comes after training and
is not charged.

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
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from asyncrl.config import EvalConfig
from asyncrl.wire.protocol import EvalReport, EvalTicket, EvalTrace

log = logging.getLogger(__name__)


@dataclass
class _Eval:
    version: int
    step: int
    pieces: dict[int, list[int]]  # piece number -> indices
    issued: dict[int, float] = field(default_factory=dict)  # piece -> clock time it was handed out
    charged: dict[int, float] = field(default_factory=dict)  # piece -> tokens charged for it, till it is reported
    traces: dict[int, list[EvalTrace]] = field(default_factory=dict)  # piece -> its report's traces
    budgeted: bool = True  # under eval.max_share: false for the starting policy's, which goes out without credit


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
    """Evaluation tokens one training token earns under ``eval.max_share`` (evaluation then holds that share of
    all tokens generated); None: no budget."""
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
        self._credit = 0.0  # evaluation tokens earned and not yet spent (a piece may overdraw it)
        self._training = (0, 0)  # samples and tokens generators reported generating for training, in all
        self._eval_handed_out = 0  # evaluation sequences handed out (a piece reissued counts again)
        self._eval_tokens = 0  # evaluation tokens reported
        self._last_piece = (0, 0)  # the latest reported piece's sequences and tokens: answers shorten as it learns
        # when training ended: evaluation's sequences handed out and tokens reported, training's samples and tokens
        self._while_training: tuple[int, int, int, int] | None = None
        self._uncounted = False  # generators that report no token counts (an older version): answers stand in

    def scheduled(self, version: int) -> bool:
        """Whether ``version`` was ever scheduled (it is evaluated once, however often it is scheduled)."""
        with self._lock:
            return version in self._scheduled

    def open(self) -> list[tuple[int, int]]:
        """The evaluations not finished, as (version, step at which it was published): kept in a checkpoint."""
        with self._lock:
            return sorted((ev.version, ev.step) for ev in self._open.values())

    def due(self, step: int) -> bool:
        every = self.config.every_steps
        return bool(every) and bool(self.indices) and step % every == 0

    def schedule(self, version: int, step: int, budgeted: bool = True) -> list[int]:
        """Evaluate ``version`` (published at ``step``). An older evaluation still runs, except under a budget
        one that has not begun, which is skipped: the versions skipped. ``budgeted`` false: its pieces go out
        without waiting for credit, and are charged (the starting policy, evaluated in full before its weights
        move on)."""
        size = self.config.items_per_request
        pieces = {i: self.indices[start : start + size] for i, start in enumerate(range(0, len(self.indices), size))}
        with self._lock:
            if version in self._scheduled:
                return []
            skipped = [v for v, ev in self._open.items() if self._earn is not None and ev.budgeted and not ev.issued]
            for v in skipped:
                del self._open[v]
            if not self._open:  # what was earned (or given back by reports) while nothing waited
                self._keep_one_piece()
            self._scheduled.add(version)
            self._open[version] = _Eval(version, step, pieces, budgeted=budgeted)
            return skipped

    def generated(self, samples: int, tokens: int) -> None:
        """Generators have reported ``samples`` training samples of ``tokens`` response tokens, in all: under a
        budget, the tokens new since the last call earn evaluation its share (kept to one piece's worth while
        nothing waits to be evaluated). Where generators report samples and never a token (an older version),
        each new sample earns as ``max_new_tokens``, the length evaluation's pieces are then charged at too: the
        budget counts answers, as it did before tokens were counted."""
        with self._lock:
            if self._while_training is not None:  # training is over: nothing earns, nothing counts
                return
            new_samples = max(0, samples - self._training[0])
            new_tokens = max(0, tokens - self._training[1])
            self._training = (max(samples, self._training[0]), max(tokens, self._training[1]))
            if new_samples and not self._training[1]:
                if not self._uncounted:
                    log.warning(
                        "the generators report no token counts (an older asyncrl?): eval.max_share counts answers"
                    )
                    self._uncounted = True
                new_tokens = new_samples * self.max_new_tokens
            if self._earn is None or not new_tokens:
                return
            self._credit += new_tokens * self._earn
            if not self._open:
                self._keep_one_piece()

    def _keep_one_piece(self) -> None:
        """Credit kept while nothing waits to be evaluated: at most one piece's worth (caller holds the lock)."""
        self._credit = min(self._credit, self._piece_estimate(self.config.items_per_request))

    def owed(self) -> float:
        """Evaluation tokens spent beyond what training has earned so far (0 when none): what must be earned
        before the next budgeted piece goes out."""
        with self._lock:
            return max(0.0, -self._credit)

    def _tokens_per_sequence(self) -> float:
        """The mean answer length to expect of evaluation (caller holds the lock): its latest reported piece's,
        else training's so far, else the longest an answer may be."""
        for sequences, tokens in (self._last_piece, self._training):
            if sequences and tokens:
                return tokens / sequences
        return float(self.max_new_tokens)

    def _piece_estimate(self, prompts: int) -> float:
        return prompts * (self.config.k + 1) * self._tokens_per_sequence()  # a greedy answer and k samples each

    def _counts(self) -> tuple[int, int, int, int]:
        """Evaluation's sequences handed out and tokens reported, training's samples and tokens: as they stood
        when training ended, or now (caller holds the lock)."""
        return self._while_training or (self._eval_handed_out, self._eval_tokens, *self._training)

    def share(self) -> float | None:
        """Evaluation's share of the sequences generated while training ran (its pieces as handed out,
        reissued ones again; training's as reported); None before any."""
        with self._lock:
            evaluation, _, training, _ = self._counts()
            total = evaluation + training
            return evaluation / total if total else None

    def token_share(self) -> float | None:
        """Evaluation's share of the tokens generated while training ran, as reported (what ``eval.max_share``
        holds; a piece's tokens count once it is reported, and a reissued piece's first copy not at all); None
        before any."""
        with self._lock:
            _, evaluation, _, training = self._counts()
            total = evaluation + training
            return evaluation / total if total else None

    def lift_budget(self) -> None:
        """Training is over: what is left to evaluate goes out at once, and the shares stop counting (generators
        still generating while the final evaluation runs count for neither side)."""
        with self._lock:
            self._earn = None
            self._while_training = self._counts()

    def next_piece(self, generator_version: int) -> EvalTicket | None:
        """A piece for a generator holding ``generator_version``: the oldest evaluation first."""
        now = self._clock()
        with self._lock:
            for ev in sorted(self._open.values(), key=lambda e: e.version):
                waits = self._earn is not None and ev.budgeted and self._credit <= 0
                if ev.version > generator_version or waits:
                    continue
                for number, indices in ev.pieces.items():
                    if number in ev.traces:
                        continue
                    if now - ev.issued.get(number, -1e18) < self.reissue_after_s:
                        continue
                    ev.issued[number] = now
                    self._eval_handed_out += len(indices) * (self.config.k + 1)
                    if self._earn is not None:
                        ev.charged[number] = self._piece_estimate(len(indices))
                        self._credit -= ev.charged[number]
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
                    self._reported(ev, number, report.traces)
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

    def _reported(self, ev: _Eval, number: int, traces: list[EvalTrace]) -> None:
        """Count a piece's tokens, and charge what its answers took in place of the estimate (caller holds the lock).
        A generator that does not count its tokens (an older one) leaves the estimate standing."""
        tokens = sum(t.tokens for t in traces)
        estimate = ev.charged.pop(number, None)
        if not tokens:
            return
        self._eval_tokens += tokens
        self._last_piece = (len(traces), tokens)
        if estimate is not None and self._earn is not None:
            self._credit += estimate - tokens

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
