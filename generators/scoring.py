"""Rewards of a generator's groups, each within ``task.reward_timeout_s``, in a helper thread.

A reward is a user's code: it may raise, return something that is not a
finite number, or hang (a sympy call, a judge model that stopped answering).
None of these may stop or hold the generator. A failed reward scores None
here, which goes out as a rollout marked ``reward_failed`` (reward 0) that
the learner leaves out of the advantages; it is counted per reason. A
scorer thread that ran out of time is abandoned (Python cannot stop a
thread) and a fresh one takes over.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncrl.observe import trace
from asyncrl.tasks.rewards import as_reward
from generators.base import Abandoned, DaemonRunner, Sample

log = logging.getLogger(__name__)

# What scoring one sample gives: its score, or why it failed ("<reason>: <detail>").
Result = float | str


class Scorer:
    """Scores samples with ``reward_fn``, each call within ``timeout_s``, and counts what failed.

    Scoring renews the learner's lease as generating does: a batch's groups
    can all finish at one engine step and be scored back to back, and a slow
    reward could otherwise outlast ``coordinator.generator_lease_s``, having
    its finished groups taken back. ``heartbeat`` is therefore called before
    each call and every ``heartbeat_every_s`` while one runs.
    ``clock`` and ``wait_until`` go to the scorer thread (:class:`DaemonRunner`).
    """

    def __init__(
        self,
        reward_fn: Callable[[str, dict[str, Any]], float],
        timeout_s: float,
        generator_id: str,
        heartbeat: Callable[[], None] = lambda: None,
        heartbeat_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wait_until: Callable[[concurrent.futures.Future, float], object] | None = None,
    ) -> None:
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.generator_id = generator_id
        self.heartbeat = heartbeat
        self.heartbeat_every_s = heartbeat_every_s
        self.failures: Counter[str] = Counter()  # reason -> count, reported with every work request
        self._clock, self._wait_until = clock, wait_until
        self._runner = self._new_runner()

    def _new_runner(self) -> DaemonRunner:
        return DaemonRunner("reward", self._clock, self._wait_until)

    def score(self, samples: list[Sample], item: dict[str, Any], ids: list[str]) -> list[float | None]:
        """Rewards of one group (rollout ids ``ids``); None where the reward failed, which is logged and counted.

        Each sample has its own time limit, so that one slow response fails
        alone; a reward that scores a group in one call (``score_group``, a
        remote reward model batching it) has one limit for the whole group.
        """
        with trace.span("reward"):
            if getattr(self.reward_fn, "score_group", None) is not None:
                results = self._within_timeout(lambda: _score_group(self.reward_fn, samples, item), len(samples))
            else:
                results = [
                    result
                    for sample in samples
                    for result in self._within_timeout(
                        lambda sample=sample: _score_one(self.reward_fn, sample, item), 1
                    )
                ]
        return [self._counted(rollout_id, result) for rollout_id, result in zip(ids, results)]

    def reward_in_time(self, text: str, item: dict[str, Any]) -> float:
        """``reward_fn(text, item)`` within ``timeout_s``, else TimeoutError; held-out evaluation scores that 0."""
        [result] = self._within_timeout(lambda: _score_one(self.reward_fn, Sample([], [], [], "stop", text), item), 1)
        if isinstance(result, str):  # a reward that failed, ran out of time or was not finite: as training counts it
            raise (TimeoutError if result.startswith("timeout") else ValueError)(result)
        return result

    def _within_timeout(self, call: Callable[[], list[Result]], n: int) -> list[Result]:
        """``call()`` in the scorer thread, or ``n`` timeouts after ``timeout_s``."""
        self.heartbeat()  # at most four times per lease: between two quick scores it asks nothing
        try:
            return self._runner.call(call, self.timeout_s, while_waiting=self.heartbeat, every_s=self.heartbeat_every_s)
        except Abandoned:
            self._runner = self._new_runner()
            return [f"timeout: no score within task.reward_timeout_s={self.timeout_s:g}"] * n

    def _counted(self, rollout_id: str, result: Result) -> float | None:
        """The score, or None for a failure, which is counted by reason and logged (the first ten, then rarely)."""
        if isinstance(result, float):
            return result
        reason = result.split(":", 1)[0]
        self.failures[reason] += 1
        if self.failures[reason] <= 10 or self.failures[reason] % 1000 == 0:
            log.warning(
                "%s: reward of %s failed (%s #%d): %s",
                self.generator_id,
                rollout_id,
                reason,
                self.failures[reason],
                result,
            )
        return None


def _score_group(reward_fn: Any, samples: list[Sample], item: dict[str, Any]) -> list[Result]:
    """One call for the whole group (a remote reward model batches it); a failure fails every sample."""
    try:
        values = [as_reward(v) for v in reward_fn.score_group([s.text for s in samples], item)]
        if len(values) != len(samples):
            raise ValueError(f"score_group returned {len(values)} scores for {len(samples)} samples")
    except Exception as exc:  # noqa: BLE001  (a user's reward must not stop generation)
        return [f"{type(exc).__name__}: {exc}"] * len(samples)
    return [v if math.isfinite(v) else "non_finite" for v in values]


def _score_one(reward_fn: Callable[[str, dict[str, Any]], Any], sample: Sample, item: dict[str, Any]) -> list[Result]:
    try:
        value = as_reward(reward_fn(sample.text, item))
    except Exception as exc:  # noqa: BLE001  (a user's reward must not stop generation)
        return [f"{type(exc).__name__}: {exc}"]
    return [value if math.isfinite(value) else "non_finite"]
