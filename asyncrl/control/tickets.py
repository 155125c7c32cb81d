"""The prompt cursor and the ticket records a learner checkpoints.

:class:`~asyncrl.control.coordinator.Coordinator` hands prompts out through a
:class:`PromptCursor` and records each ticket it has out as an
:class:`OutstandingTicket`. A :class:`CoordinatorState` holds both, so a
resumed learner hands out the same prompts and waits on the same tickets.
"""

from __future__ import annotations

import random

import msgspec


class PromptCursor:
    """Walks a shuffled order of prompt indices, reshuffling each epoch.

    The whole state is ``(epoch, position)``, so a checkpoint can restore it.
    """

    def __init__(self, num_prompts: int, seed: int, epoch: int = 0, position: int = 0) -> None:
        if num_prompts < 1:
            raise ValueError("the task has no prompts")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.position = epoch, position
        self._order = self._shuffled(epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> int:
        """The next prompt index; after the last of an epoch, the first of a new shuffle."""
        if self.position >= self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffled(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index


class OutstandingTicket(msgspec.Struct, frozen=True):
    """A ticket handed out and not yet completed; checkpointed by the learner."""

    prompt_index: int
    group_id: str
    generator_id: str


class CoordinatorState(msgspec.Struct):
    """Everything needed to resume handing out tickets after a learner restart."""

    session: str
    next_group: int
    epoch: int
    position: int
    outstanding: list[OutstandingTicket]
    requeued: list[tuple[int, str | None]]
    retired: list[int] = []  # prompts a generator's engine refused: never issued again
    written: list[str] = []  # tickets out whose group is in a durable buffer (WorkRequest.written)
    incarnations: dict[str, str] = {}  # generator id -> the process that last asked (WorkRequest.incarnation)
