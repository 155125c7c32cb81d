"""Rank 0's account of each step: its metrics record, the rollouts consumed and dropped, and the buffer's acks.

``metrics.jsonl`` holds one record per step (mirrored to TensorBoard),
``consumed.jsonl`` one line per rollout trained on and ``dropped.jsonl`` one
per rollout received and not trained on. A durable buffer (Redis) is
acknowledged only once a checkpoint holds the steps that used its rollouts,
so a crash before then redelivers them; with ZeroMQ a rollout is done with
at its step.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from asyncrl.wire.protocol import Rollout
from learners.batcher import GroupBatcher


@dataclass
class StepTimes:
    """Where one step's seconds went: training, waiting for its batch, publishing, and the run so far."""

    step_s: float
    wait_s: float
    publish_s: float
    sent: dict[str, float]  # the sender's latest completed send (push_s or publish_write_s)
    wall_s: float  # the run's training time up to this step


class RewardWindow:
    """The training reward's mean over the last ``steps`` steps, against ``learner.stop_at_reward``."""

    def __init__(self, target: float | None, steps: int) -> None:
        self.target = target
        self.rewards: deque[float] = deque(maxlen=steps)

    def add(self, reward: float | None) -> None:
        if reward is not None:  # a step of only unscored rollouts has no reward
            self.rewards.append(reward)

    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    def reached(self) -> bool:
        """A whole window of steps whose mean reward is at least the target (never without a target)."""
        full = len(self.rewards) == self.rewards.maxlen
        return self.target is not None and full and self.mean() >= self.target


def token_staleness(version: int, batch: list[Rollout]) -> float:
    """How many versions behind ``version`` the batch's trained response tokens were sampled, on average.

    A sample's staleness is that of its oldest token; with weights that land mid-answer
    (``generator.update_in_flight``) most of its tokens may be newer, and this says by how much. It is what
    the loss, a mean over tokens, sees: an episode's environment replies (not trained on) are left out, and
    a long answer weighs more here than in ``staleness_mean``, which counts each sample once.
    """
    behind = tokens = 0
    for rollout in batch:
        mask = rollout.loss_mask or [1] * len(rollout.versions)
        behind += sum(version - v for v, trained in zip(rollout.versions, mask) if trained)
        tokens += sum(mask)
    return behind / tokens if tokens else 0.0


class Records:
    """Writes rank 0's records of each step and acknowledges the buffer; ``driver`` is the learner's
    :class:`~learners.trainer.Driver`.

    It also follows the rewards: ``last_reward`` is the latest step's mean scored reward, and ``failure``
    says why the run must stop when no reward was ever scored (``task.unscored_steps_to_fail``).
    """

    def __init__(
        self, run_dir: Path, driver, batcher: GroupBatcher, durable: bool, unscored_steps_to_fail: int
    ) -> None:
        self.driver, self.batcher = driver, batcher
        self.bound = driver.coordinator.bound
        self._consumed_log = open(run_dir / "consumed.jsonl", "a", buffering=1)
        # With ZeroMQ a drop is final; with Redis it is acknowledged at the next checkpoint, and one after
        # the checkpoint a resumed learner reads is delivered to it again (resume cuts the log back).
        self._dropped_log = open(run_dir / "dropped.jsonl", "a", buffering=1)
        self.ack_at_checkpoint = durable
        self.unacked: list[str] = []
        self.last_reward: float | None = None
        self.failure: str | None = None  # why the run must stop (every reward failing from the start)
        self._unscored_steps = 0  # steps in a row with no reward scored, before any step had one
        self._unscored_steps_to_fail = unscored_steps_to_fail

    def metrics(
        self, step: int, version: int, batch: list[Rollout], staleness: list[int], stats: dict, times: StepTimes
    ) -> dict:
        """Write the step's record to ``metrics.jsonl`` and return it; the batcher's wait counters start again."""
        batcher = self.batcher
        reward = self._follow_reward(batch)
        record = {
            "step": step,
            "version": version,
            "reward": reward,
            "reward_failed": sum(r.reward_failed for r in batch),  # left out of reward and of advantages
            "samples": len(batch),
            "tokens": sum(len(r.response_ids) for r in batch),
            "response_len": sum(len(r.response_ids) for r in batch) / len(batch),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "dropped_stale": self.bound.dropped["stale"],
            "step_s": times.step_s,
            "wait_s": times.wait_s,
            # wait_s by cause: generation behind, the buffer's own work, housekeeping, and the rest
            # (assembling groups, staleness checks, handing the order to other ranks).
            "wait_rollouts_s": batcher.wait_rollouts_s,
            "wait_buffer_s": batcher.buffer_s,
            "wait_housekeeping_s": batcher.housekeeping_s,
            "wait_other_s": max(
                0.0, times.wait_s - batcher.wait_rollouts_s - batcher.buffer_s - batcher.housekeeping_s
            ),
            "publish_s": times.publish_s,
            **times.sent,
            "wall_s": times.wall_s,
            "samples_per_s": self.bound.consumed / max(times.wall_s, 1e-9),
            # what the generators say they have sampled in all (their reports lag a little): generated samples/s
            "generated_samples": self.driver.coordinator.samples_generated(),
            **stats,
            **episode_metrics(batch),
        }
        self.driver.metrics.write(record)
        batcher.buffer_s = batcher.wait_rollouts_s = batcher.housekeeping_s = 0.0
        return record

    def _follow_reward(self, batch: list[Rollout]) -> float | None:
        """The batch's mean scored reward; a failed reward is not a wrong answer, so it is left out."""
        scored = [r.reward for r in batch if not r.reward_failed]
        reward = sum(scored) / len(scored) if scored else None
        if reward is not None:
            self.last_reward = reward
        elif self.last_reward is None:
            self._note_unscored_step()
        return reward

    def _note_unscored_step(self) -> None:
        """Another step, since the start, on which every reward failed: past ``task.unscored_steps_to_fail`` the
        run stops, naming the failures, instead of training on advantages of 0 for its whole budget."""
        self._unscored_steps += 1
        limit = self._unscored_steps_to_fail
        if not limit or self._unscored_steps < limit:
            return
        failures = Counter()
        for generator in self.driver.coordinator.generator_list():
            failures.update(generator.reward_failures)
        why = ", ".join(f"{reason}: {count}" for reason, count in failures.most_common()) or "see the generator logs"
        self.failure = (
            f"no reward was scored in the first {self._unscored_steps} steps: every reward failed "
            f"({why}); check task.reward / task.rewards and the generator logs, which name the error "
            "(task.unscored_steps_to_fail: 0 trains on all the same)"
        )

    def consumed(self, step: int, batch: list[Rollout], staleness: list[int]) -> None:
        """Log the step's rollouts and the drops since the last step, then acknowledge them (or hold the acks
        for the next checkpoint)."""
        lines = [
            json.dumps(
                {
                    "id": r.rollout_id,
                    "step": step,
                    "staleness": s,
                    "prompt": r.prompt_index,
                    "generator": r.generator_id,
                }
            )
            for r, s in zip(batch, staleness)
        ]
        self._consumed_log.write("".join(line + "\n" for line in lines))
        drops = [json.dumps({"id": i, "step": step, "reason": why}) for i, why in self.batcher.dropped]
        self._dropped_log.write("".join(line + "\n" for line in drops))
        self.batcher.consumed_ids.update(r.rollout_id for r in batch)
        done = [r.rollout_id for r in batch] + [i for i, _ in self.batcher.dropped]
        if self.ack_at_checkpoint:
            # Drops wait for the checkpoint too: a group's stale members are dropped beside its members trained
            # on, and after a crash before the checkpoint its ticket is out again and needs every member back.
            self.unacked += done
            done = []
        self.driver.reader.ack(done)
        self.batcher.dropped.clear()

    def checkpointed(self) -> None:
        """A checkpoint now holds every step so far: acknowledge what waited for it."""
        if self.unacked:
            self.driver.reader.ack(self.unacked)
            self.unacked = []


def episode_metrics(batch: list[Rollout]) -> dict[str, float]:
    """A multi-turn batch's episodes: turns, tool calls, tool errors by kind (sums), tool latency, environment
    time against generation time, truncations, and the share of tokens the environment wrote (masked out)."""
    episodes = [r.episode for r in batch if r.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    summed: Counter[str] = Counter()
    for episode in episodes:
        summed.update(episode.metrics)
    calls = summed.pop("tool_calls", 0.0)
    tool_s = summed.pop("tool_s", 0.0)
    tokens = sum(len(r.response_ids) for r in batch)
    out = {
        "turns": sum(e.turns for e in episodes) / n,
        "tool_calls": calls / n,
        "tool_call_s": tool_s / calls if calls else 0.0,
        "env_s": sum(e.env_s for e in episodes) / n,
        "turn_generate_s": sum(e.generate_s for e in episodes) / n,
        "truncated": sum(e.truncated for e in episodes) / n,
        "masked_token_fraction": (tokens - sum(r.trained_tokens for r in batch)) / max(tokens, 1),
    }
    for name, value in summed.items():  # tool_errors/<kind> as counts; an environment's own numbers as means
        out[name if name.startswith("tool_errors/") else f"env/{name}"] = (
            value if name.startswith("tool_errors/") else value / n
        )
    return out
