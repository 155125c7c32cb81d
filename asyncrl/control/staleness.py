"""The hard per-sample staleness bound, in one small pure class.

Vocabulary (``DESIGN.md``): the learner's policy version ``v`` starts at 0 and
grows by one per weight publish. A sample's staleness is the learner version
at the optimizer step that consumes it minus the oldest policy version among
its tokens. ``max_staleness`` bounds it for every sample; 0 is synchronous
on-policy training through the same code path.

Two mechanisms enforce the bound:

* **Consumption** (:meth:`StalenessBound.accept`) is the guarantee: a sample
  over the bound is dropped and counted, never trained on. With
  ``on_exceed="correct"`` it is kept instead, counted as ``corrected``, and
  the learner's off-policy correction (``algo.off_policy``) weights it: long
  rollouts, which span the most versions, are then not the ones thrown away.
* **Admission** (:meth:`StalenessBound.admit`) is the backpressure that keeps
  drops rare: a generator holding weights ``w`` may only start samples that
  the learner will consume while its version is at most ``w + max_staleness``.
  The learner consumes ``samples_per_version`` samples per version, so
  sample number ``k`` (counting every sample admitted and not dropped) is
  consumed at version ``k // samples_per_version``; admitting it keeps the
  bound iff ``k < (w + max_staleness + 1) * samples_per_version``.

With ``max_staleness = 0`` this admits exactly one version's worth of samples
per published version, and the generators wait for every update: the
synchronous baseline.
"""

from __future__ import annotations

import threading
from collections import Counter


class StalenessBound:
    """Admission control and the consumption check for ``max_staleness``.

    Thread-safe: the learner's request handler calls :meth:`admit` while its
    training loop calls :meth:`accept` and :meth:`release`.
    """

    def __init__(self, max_staleness: int, samples_per_version: int, on_exceed: str = "drop") -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if samples_per_version < 1:
            raise ValueError(f"samples_per_version must be >= 1, got {samples_per_version}")
        if on_exceed not in ("drop", "correct"):
            raise ValueError(f"on_exceed must be 'drop' or 'correct', got {on_exceed!r}")
        self.max_staleness = max_staleness
        self.on_exceed = on_exceed
        self.corrected = 0  # samples over the bound that were kept (on_exceed="correct")
        self.samples_per_version = samples_per_version
        self._lock = threading.Lock()
        self._admitted = 0  # samples admitted, minus those released
        self._consumed = 0
        self.dropped: Counter[str] = Counter()

    @property
    def admitted(self) -> int:
        """Samples admitted so far and still counted against the bound."""
        return self._admitted

    @property
    def consumed(self) -> int:
        """Samples that passed :meth:`accept`."""
        return self._consumed

    def capacity(self, weight_version: int) -> int:
        """How many more samples a generator at ``weight_version`` may start now."""
        limit = (weight_version + self.max_staleness + 1) * self.samples_per_version
        return max(0, limit - self._admitted)

    def admit(self, weight_version: int, groups: int, group_size: int) -> int:
        """Admit up to ``groups`` groups of ``group_size`` samples; returns how many."""
        with self._lock:
            granted = max(0, min(groups, self.capacity(weight_version) // group_size))
            self._admitted += granted * group_size
            return granted

    def release(self, samples: int, reason: str) -> None:
        """Give back admission slots of samples that will never be consumed.

        Called for admitted samples that were dropped (stale, malformed) or
        lost (a generator died with them in flight), so that they do not hold
        a consumption slot forever.
        """
        with self._lock:
            self._admitted -= samples
            self.dropped[reason] += samples

    def verdict(self, oldest_version: int, learner_version: int) -> str | None:
        """``None`` if a sample may be trained on at ``learner_version``, else why not.

        A version newer than the learner's comes from weights published after
        the learner's last checkpoint: a timeline a resumed learner discarded.
        """
        if oldest_version > learner_version:
            return "future_version"
        if learner_version - oldest_version > self.max_staleness:
            return "stale"
        return None

    def keeps(self, reason: str | None) -> bool:
        """Whether a sample with this :meth:`verdict` is trained on."""
        return reason is None or (reason == "stale" and self.on_exceed == "correct")

    def accept(self, oldest_version: int, learner_version: int) -> bool:
        """The consumption check: counts the sample as consumed (or corrected) or as dropped."""
        reason = self.verdict(oldest_version, learner_version)
        if self.keeps(reason):
            with self._lock:
                self._consumed += 1
                self.corrected += reason is not None
            return True
        self.release(1, reason)
        return False

    def state(self) -> dict[str, object]:
        """Counters for the learner's checkpoint."""
        with self._lock:
            return {
                "admitted": self._admitted,
                "consumed": self._consumed,
                "dropped": dict(self.dropped),
                "corrected": self.corrected,
            }

    def restore(self, state: dict[str, object]) -> None:
        """Set the counters from a checkpoint's :meth:`state`, replacing the current ones; a state without
        ``corrected`` (written before it was counted) restores it as 0."""
        with self._lock:
            self._admitted = int(state["admitted"])
            self._consumed = int(state["consumed"])
            self.dropped = Counter(state["dropped"])
            self.corrected = int(state.get("corrected", 0))
