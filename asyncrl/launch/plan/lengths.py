"""Response lengths for the simulation: a run's histogram, or a lognormal cut off at the longest answer.

A run's answers change length as it learns (the SmolLM2 arithmetic run's went
from 87 tokens to 17 in 50 steps), so a distribution can be moved to another
mean with :meth:`Lengths.with_mean`, which the pipeline's per-phase length
scale uses. The lognormal is solved for the mean *after* the cut, because
that is what a run's ``response_len`` reports.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _cut_mean(mu: float, sigma: float, most: float) -> float:
    """The mean of ``min(X, most)`` for ``X`` lognormal(``mu``, ``sigma``)."""
    cut = math.log(most)
    kept = math.exp(mu + sigma**2 / 2) * _normal_cdf((cut - mu - sigma**2) / sigma)
    return kept + most * (1.0 - _normal_cdf((cut - mu) / sigma))


@dataclass(frozen=True)
class Lengths:
    """Response lengths in tokens: an empirical histogram, or a lognormal cut off at ``max_tokens``."""

    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    mean_tokens: float = 0.0  # the lognormal's mean before the cut
    max_tokens: int = 0
    sigma: float = 0.8

    @classmethod
    def histogram(cls, counts: dict[int, float]) -> Lengths:
        """Lengths drawn in proportion to ``counts`` (length -> how many samples had it)."""
        kept = {int(k): float(v) for k, v in counts.items() if v > 0}
        if not kept:
            raise ValueError("a length histogram needs at least one length with a count above 0")
        total = sum(kept.values())
        return cls(values=tuple(kept), weights=tuple(v / total for v in kept.values()))

    @classmethod
    def lognormal(cls, mean_tokens: float, max_tokens: int, sigma: float = 0.8) -> Lengths:
        """Lengths with this mean before the cut; those past ``max_tokens`` are truncated to it, as generation is."""
        if not 0 < mean_tokens <= max_tokens:
            raise ValueError(f"mean length {mean_tokens} must be above 0 and at most the max length {max_tokens}")
        return cls(mean_tokens=mean_tokens, max_tokens=max_tokens, sigma=sigma)

    def draw(self, rng: np.random.Generator, n: int | tuple[int, ...]) -> np.ndarray:
        """``n`` lengths, at least one token each."""
        if self.values:
            return rng.choice(np.array(self.values), size=n, p=np.array(self.weights))
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, size=n)), 1, self.max_tokens)

    def mean(self) -> float:
        """The mean length, truncation included."""
        if self.values:
            return float(np.dot(self.values, self.weights))
        return _cut_mean(math.log(self.mean_tokens) - self.sigma**2 / 2, self.sigma, self.max_tokens)

    def with_mean(self, target: float) -> Lengths:
        """The same shape moved to mean ``target`` tokens: a histogram's lengths scaled, a lognormal's
        pre-cut mean solved for (a mean at the cut, as an answer that always runs to the limit, is kept
        just under it)."""
        if target <= 0:
            raise ValueError(f"a mean length must be above 0, not {target}")
        if self.values:
            factor, moved = target / self.mean(), Counter()
            for value, weight in zip(self.values, self.weights):
                moved[max(1, round(value * factor))] += weight
            return Lengths.histogram(moved)
        target = min(target, 0.995 * self.max_tokens)
        low, high = math.log(1e-3), math.log(self.max_tokens) + 10 * self.sigma**2 + 10
        for _ in range(80):  # bisection on the pre-cut mu: the cut mean grows with it
            mid = (low + high) / 2
            low, high = (mid, high) if _cut_mean(mid, self.sigma, self.max_tokens) < target else (low, mid)
        pre_cut = math.exp((low + high) / 2 + self.sigma**2 / 2)
        return Lengths(mean_tokens=pre_cut, max_tokens=self.max_tokens, sigma=self.sigma)
