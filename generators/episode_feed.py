"""A generator's side of multi-turn tasks: more tickets while episodes run, and each group's rollouts.

The worker hands a batch of tickets to the :class:`generators.episodes.EpisodeRunner`;
:class:`TicketFeed` asks the learner for more whenever fewer than half a
request's episodes are in flight, so that no batch waits for its slowest
episode and the episodes' waits on their tools do not fall together. It asks
no more once the learner says stop or hands out an evaluation (which runs
after the episodes in flight end, on the same engine), nor more often than
``generator.update_poll_s``. Each answer's newest weights are taken between
two engine steps, as mid-batch updates are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.wire.protocol import EvalTicket, Rollout
from generators.episodes import Episode, episode_rollout
from generators.learner_link import LearnerLink
from generators.weight_updates import WeightUpdater


class TicketFeed:
    """Tickets for an :class:`~generators.episodes.EpisodeRunner` to start while others run."""

    def __init__(
        self,
        config: RunConfig,
        link: LearnerLink,
        weights: WeightUpdater,
        items: list[dict[str, Any]],
        clock: Callable[[], float],
    ) -> None:
        self.config, self.link, self.weights, self.items, self._clock = config, link, weights, items, clock
        gen = config.generator
        self.below = gen.groups_per_request * gen.samples_per_prompt // 2  # episodes in flight that call for more
        self.held_eval: EvalTicket | None = None  # handed out while episodes ran: run once they end
        self._next_ask_at = 0.0

    def start(self) -> None:
        """A new batch: ask when needed."""
        self._next_ask_at = 0.0

    def more(self) -> list[tuple[str, int, dict[str, Any]]]:
        """Up to a request's worth of new tickets, as ``(group_id, prompt_index, item)``; none when it should not
        ask now."""
        if self.link.draining or self.held_eval is not None or self._clock() < self._next_ask_at:
            return []
        reply = self.link.ask(self.config.generator.groups_per_request, wait=False)  # episodes are in flight
        self._next_ask_at = self._clock() + max(reply.retry_after_s, self.config.generator.update_poll_s)
        if reply.stop:  # the worker's next ask, after the episodes in flight, hears it again and stops
            self._next_ask_at = float("inf")
            return []
        self.weights.apply(reply.latest)
        if reply.eval is not None:
            self.held_eval = reply.eval
        tickets = [t for t in reply.tickets if not self.link.known_refused(t)]
        return [(t.group_id, t.prompt_index, self.items[t.prompt_index]) for t in tickets]


def group_rollouts(
    episodes: list[Episode],
    score: Callable[[list[Any], dict[str, Any], list[str]], list[float | None]],
    config: RunConfig,
    generator_id: str,
    took_s: float,
) -> list[Rollout]:
    """One group's episodes as rollouts; ``score`` (the task's reward) scores those their environment did not."""
    settings = config.episode
    unscored = [
        e for e in episodes if not e.dropped and e.reward is None and not (e.truncated and settings.truncated != "keep")
    ]
    scores = score([e.last for e in unscored], episodes[0].item, [e.key for e in unscored]) if unscored else []
    rewards = {e.key: e.reward for e in episodes} | {e.key: r for e, r in zip(unscored, scores)}
    return [episode_rollout(e, len(episodes), rewards[e.key], settings, generator_id, took_s) for e in episodes]
