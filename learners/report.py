"""What rank 0 shows of a run: the ``asyncrl status`` snapshot, Prometheus metrics, and ``summary.json``.

The learner's main thread hands its state over (:meth:`RunView.refresh`,
``last_record``); the coordinator's thread and the metrics endpoint's thread
only read what was handed over, replaced whole, never live training state.
"""

from __future__ import annotations

import time
from collections import Counter

import msgspec

from asyncrl.config import RunConfig
from asyncrl.observe.prometheus import Metric
from asyncrl.wire.protocol import Status, now_s
from learners.batcher import GroupBatcher

# The step record's durations as Prometheus names them, in its base unit.
_SECONDS = {
    "step_s": "step_seconds",
    "wait_s": "wait_seconds",
    "publish_s": "publish_seconds",
    "push_s": "push_seconds",
    "publish_write_s": "publish_write_seconds",
}


def peak_memory_gib() -> float | None:
    """The most GPU memory this process's tensors held at once, in GiB; None without a GPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


class RunView:
    """Snapshots of one run, built on the learner's main thread and read from any thread."""

    def __init__(self, config: RunConfig, driver, batcher: GroupBatcher, started_s: float) -> None:
        self.config = config
        self.driver = driver
        self.bound = driver.coordinator.bound
        self.batcher = batcher
        self.started_s = started_s
        self.last_record: dict[str, float] = {}
        self._status: Status | None = None
        self._status_at = 0.0

    def summary(
        self,
        *,
        step: int,
        version: int,
        world_size: int,
        wall_s: float,
        busy_s: float,
        left_over: int,
        evaluation: dict,
    ) -> dict:
        """``summary.json``: throughput, efficiency, and where every rollout went."""
        generators = self.driver.coordinator.generator_list()
        generator_capacity = sum(g.samples_generated / g.busy_s for g in generators if g.busy_s > 0)
        consumed = self.bound.consumed
        learner_capacity = consumed / busy_s if busy_s else 0.0
        achieved = consumed / wall_s if wall_s else 0.0
        capacities = [c for c in (generator_capacity, learner_capacity) if c > 0]
        return {
            "steps": step,
            "version": version,
            "learner_ranks": world_size,
            "max_staleness": self.bound.max_staleness,
            "wall_s": wall_s,
            "samples_consumed": consumed,
            # Rollouts received and not trained on, by reason: the same records as dropped.jsonl.
            "samples_dropped": dict(self.batcher.drops),
            # Admission slots given back without a rollout trained on (a generator lost, a ticket timed out...).
            "slots_released": dict(self.bound.dropped),
            "samples_left_in_buffer": left_over,
            "achieved_samples_per_s": achieved,
            "learner_capacity_samples_per_s": learner_capacity,
            "generator_capacity_samples_per_s": generator_capacity,
            "pipeline_efficiency": achieved / min(capacities) if capacities else 0.0,
            # Stale samples kept and weighted by the off-policy correction (staleness.on_exceed: correct).
            "samples_corrected": self.bound.corrected,
            "staleness_by_length": self.batcher.staleness_by_length(),
            "rejected_messages": dict(self.driver.reader.rejections.by_reason),
            "reward_failures": dict(sum((Counter(g.reward_failures) for g in generators), Counter())),
            "eval": evaluation,
            "control_plane_errors": self.driver.server.errors if self.driver.server else 0,
            "control_plane_rejected": self.driver.server.rejected if self.driver.server else 0,
            # The most accelerator memory rank 0's tensors held at once (None on a CPU).
            "learner_peak_memory_gib": peak_memory_gib(),
        }

    def refresh(self, step: int, version: int, reward: float | None, unacked: int, force: bool = False) -> None:
        """The main thread: rebuild the snapshot ``asyncrl status`` reads (at most 4 times a second)."""
        now = time.monotonic()
        if not force and now - self._status_at < 0.25:
            return
        self._status_at = now
        stats = {k: float(v) for k, v in self.driver.reader.stats().items()}
        oldest = self.batcher.oldest_waiting_version
        if oldest is not None:
            stats["oldest_waiting_staleness"] = float(version - oldest)
        stats["unacked_until_checkpoint"] = float(unacked)
        stats["waiting"] = float(self.batcher.waiting)
        self._status = Status(
            step=step,
            total_steps=self.config.learner.total_steps,
            version=version,
            max_staleness=self.bound.max_staleness,
            samples_consumed=self.bound.consumed,
            samples_dropped=dict(self.batcher.drops),
            samples_admitted=self.bound.admitted,
            buffer=stats,
            rejected=dict(self.driver.reader.rejections.by_reason),
            generator_lease_s=self.driver.coordinator.lease_s,
            generators=[],
            reward=reward,
            started_s=self.started_s,
            samples_per_s=self.last_record.get("samples_per_s") if self.last_record else None,
            run_id=self.config.coordinator.run_id,
        )

    def prometheus_metrics(self) -> list[Metric]:
        """What ``/metrics`` shows, from the latest snapshot and step record (read on the endpoint's thread)."""
        s, r = self._status, self.last_record
        generators = self.driver.coordinator.generator_list()
        out = [
            Metric("learner_step", "optimizer steps taken", s.step),
            Metric("policy_version", "the learner's latest published policy version", s.version),
            Metric("samples_consumed", "rollouts trained on", s.samples_consumed, counter=True),
            # Granted minus given back (a stale drop, a generator lost): it goes down, so not a counter.
            Metric(
                "samples_admitted",
                "admission slots held against the staleness bound: samples trained on or in flight",
                s.samples_admitted,
            ),
            Metric(
                "samples_dropped", "rollouts received and not trained on, by reason", s.samples_dropped, counter=True
            ),
            Metric(
                "buffer_rejected",
                "buffer entries refused before decoding or validation, by reason",
                s.rejected,
                counter=True,
            ),
            Metric("buffer_waiting", "rollouts received and waiting for a batch", s.buffer.get("waiting", 0.0)),
            # As the coordinator last heard: each generator's own /metrics has generator_weight_version and
            # generator_samples, and a sum over both names would count every sample twice.
            Metric(
                "coordinator_generator_weight_version",
                "the policy version each generator last reported",
                {g.generator_id: g.weight_version for g in generators},
                label="generator",
            ),
            Metric(
                "coordinator_generator_samples",
                "samples each generator last reported having generated",
                {g.generator_id: g.samples_generated for g in generators},
                counter=True,
                label="generator",
            ),
        ]
        names = {
            "reward": "mean reward of the last step's scored samples",
            "reward_failed": "samples of the last step whose reward failed",
            "staleness_mean": "mean staleness of the last step's samples",
            "staleness_max": "largest staleness in the last step's batch",
            "token_staleness_mean": "versions behind the learner the last step's response tokens were sampled, mean",
            "samples_per_s": "samples trained per second since the first batch",
            "step_s": "seconds of the last optimizer step",
            "wait_s": "seconds the last step waited for data",
            "publish_s": "seconds the last publish held up the learner (the write too without background_publish)",
            "push_s": "seconds the latest completed weight push took",
            "publish_write_s": "seconds the latest completed weight folder write took (on its own thread)",
        }
        # A step whose every reward failed has no reward: the gauge is left out until one has. Durations are
        # named in seconds, Prometheus's base unit (the record's step_s is asyncrl_step_seconds).
        out += [
            Metric(_SECONDS.get(name, name), help, r[name]) for name, help in names.items() if r.get(name) is not None
        ]
        return out

    def status(self) -> Status:
        """The latest snapshot, for ``asyncrl status``; called from the coordinator thread.

        Nothing here reads the main thread's live state: the snapshot is
        replaced whole by :meth:`refresh`, and the generator list is
        copied under the coordinator's lock.
        """
        return msgspec.structs.replace(self._status, generators=self.driver.coordinator.generator_list(), now_s=now_s())
