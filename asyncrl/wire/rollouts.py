"""The wire messages of the data plane: a rollout, as a generator writes it and the learner trains on it.

Import them from :mod:`asyncrl.wire.protocol`, the one module that defines
what crosses a process boundary; this module is its part for rollouts.
"""

from __future__ import annotations

import math

import msgspec

from asyncrl.wire.schema import TaggedMessage


class EpisodeStats(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a multi-turn episode went: its turns, its environment's numbers, and where its time went."""

    turns: int = 1
    truncated: bool = False  # it ran out of episode.max_turns or episode.max_tokens
    env_s: float = 0.0  # in the environment's reset and steps (tools included)
    generate_s: float = 0.0  # waiting for the engine's tokens
    metrics: dict[str, float] = {}  # summed over the episode's steps: tool_calls, tool_s, tool_errors/<kind>...


class Rollout(TaggedMessage, tag="rollout"):
    """One sampled response to one prompt, with everything the learner needs.

    ``logprobs[i]`` is the behaviour log-prob of ``response_ids[i]`` under the
    weights of version ``versions[i]``: a weight update that lands while the
    sequence is generated shows up as a change of version mid-sequence.

    A multi-turn episode travels as one rollout: ``response_ids`` holds every
    turn as sampled and every environment reply as the chat template renders
    it, and ``loss_mask`` is 1 on the model's tokens and 0 on the
    environment's (empty: every token is the model's). An environment token's
    log-prob is 0 and its version the model token's before it, so the oldest
    version is the oldest the model sampled with. ``dropped`` names why an
    episode cannot be trained on (its environment raised); the learner drops
    it with that reason.
    """

    rollout_id: str
    group_id: str
    group_size: int
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    finish_reason: str
    generator_id: str
    created_s: float
    generate_s: float = 0.0
    reward_failed: bool = False  # the reward raised, was not a finite number or timed out; ``reward`` is then 0
    loss_mask: list[int] = []
    episode: EpisodeStats | None = None
    dropped: str = ""

    def problem(self, vocab_size: int | None = None) -> tuple[str, str] | None:
        """``(reason, detail)`` if this rollout must not be trained on, else None.

        Receivers call it on every rollout, valid ticket or not: one NaN
        log-prob or reward poisons a whole step's loss, and a token id past
        the vocabulary crashes the learner's embedding lookup.
        """
        n = len(self.response_ids)
        if self.dropped:
            return None  # carries no tokens to check; the learner drops it, with its reason, once its group is in
        if self.loss_mask and (len(self.loss_mask) != n or not set(self.loss_mask) <= {0, 1}):
            return "invalid_field", f"loss_mask must hold one 0 or 1 per response token ({len(self.loss_mask)}, {n})"
        if n == 0:
            return "empty_response", "response_ids is empty"
        if len(self.logprobs) != n or len(self.versions) != n:
            return "length_mismatch", (
                f"response_ids, logprobs and versions must have one entry per token "
                f"({n}, {len(self.logprobs)}, {len(self.versions)})"
            )
        if not self.prompt_ids:
            return "empty_prompt", "prompt_ids is empty"
        if self.group_size < 1:
            return "invalid_field", f"group_size must be >= 1, got {self.group_size}"
        # One pass each in C: a NaN or inf anywhere makes the sum non-finite.
        if not math.isfinite(sum(self.logprobs)) or max(self.logprobs) > 1e-3:
            bad = next((i for i, x in enumerate(self.logprobs) if not (math.isfinite(x) and x <= 1e-3)), -1)
            return "non_finite_logprobs", f"logprobs[{bad}] = {self.logprobs[bad]!r} (must be finite and <= 0)"
        if not math.isfinite(self.reward):
            return "non_finite_reward", f"reward = {self.reward!r}"
        if min(self.versions) < 0:
            return "invalid_field", f"versions holds {min(self.versions)} (must be >= 0)"
        low = min(min(self.prompt_ids), min(self.response_ids))
        high = max(max(self.prompt_ids), max(self.response_ids))
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad_value = low if low < 0 else high
            return "token_out_of_range", f"token id {bad_value} outside [0, {vocab_size})"
        return None

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among this rollout's tokens (a dropped episode's: its first's, or 0)."""
        return min(self.versions, default=0)

    @property
    def trained_tokens(self) -> int:
        """How many tokens the loss sees: the model's."""
        return sum(self.loss_mask) if self.loss_mask else len(self.response_ids)


class RolloutLimits(msgspec.Struct, frozen=True):
    """What a receiver accepts: the size cap (checked before decoding) and the model's vocabulary."""

    max_bytes: int
    vocab_size: int | None = None
