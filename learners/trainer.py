"""The learner loop: assemble groups, enforce staleness, step, publish weights.

Generators and learners never import each other; everything here speaks to
generators through the buffer (rollouts in) and the coordinator (tickets and
weight versions out).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from asyncrl import weights
from asyncrl.config import RunConfig
from asyncrl.coordinator import Coordinator
from asyncrl.metrics import MetricsWriter
from asyncrl.protocol import Rollout, Status, now_s
from asyncrl.staleness import StalenessBound
from buffers import RolloutReader
from learners.engine import gathered_parameters
from learners.loss import group_advantages, ppo_clip_loss

log = logging.getLogger(__name__)


class GroupBatcher:
    """Turns the rollout stream into batches of complete, fresh groups.

    A group is complete once all ``group_size`` of its samples arrived. The
    staleness check runs when a group is taken into a batch, at the version
    of the step that will consume it, which is the moment the bound is about.
    """

    def __init__(self, reader: RolloutReader, bound: StalenessBound, coordinator: Coordinator,
                 timeout_s: float) -> None:
        self.reader = reader
        self.bound = bound
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self._pending: dict[str, list[Rollout]] = defaultdict(list)
        self._complete: list[list[Rollout]] = []
        self.dropped_ids: list[str] = []

    def next_batch(self, num_groups: int, learner_version: int) -> list[Rollout]:
        """``num_groups`` groups with at least one fresh sample each, flattened.

        Raises ``TimeoutError`` when no rollout arrives for ``timeout_s``.
        """
        batch: list[Rollout] = []
        taken = 0
        deadline = time.monotonic() + self.timeout_s
        while taken < num_groups:
            if not self._complete:
                self._read(deadline)
                deadline = time.monotonic() + self.timeout_s if self._complete else deadline
                continue
            fresh = self._fresh(self._complete.pop(0), learner_version)
            if fresh:
                batch.extend(fresh)
                taken += 1
        return batch

    def _read(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"no complete rollout group for {self.timeout_s:.0f}s (learner.batch_timeout_s): "
                "are the generators running and pointed at this buffer?"
            )
        for rollout in self.reader.get(max_items=4096, timeout_s=min(1.0, remaining)):
            members = self._pending[rollout.group_id]
            members.append(rollout)
            if len(members) == rollout.group_size:
                del self._pending[rollout.group_id]
                self.coordinator.complete(rollout.group_id)
                self._complete.append(members)

    def _fresh(self, group: list[Rollout], learner_version: int) -> list[Rollout]:
        fresh = []
        for rollout in group:
            if self.bound.accept(rollout.oldest_version, learner_version):
                fresh.append(rollout)
            else:
                self.dropped_ids.append(rollout.rollout_id)
        return fresh


def _microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices so that rows x longest row stays within ``max_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class Learner:
    """One learner process (rank 0 of the group in this version)."""

    def __init__(self, config: RunConfig, engine, model: torch.nn.Module, reader: RolloutReader,
                 coordinator: Coordinator, metrics: MetricsWriter) -> None:
        self.config = config
        self.engine = engine
        self.model = model
        self.reader = reader
        self.coordinator = coordinator
        self.bound = coordinator.bound
        self.metrics = metrics
        self.batcher = GroupBatcher(reader, self.bound, coordinator, config.learner.batch_timeout_s)
        self.step = 0
        self.version = 0
        self.busy_s = 0.0
        self.last_reward: float | None = None
        self.started_s = now_s()
        self.run_dir = Path(config.run_dir)
        self.weights_dir = Path(config.learner.weights_dir or self.run_dir / "weights")
        self._model_config_json = model.config.to_json_string()
        self._consumed_log = open(self.run_dir / "consumed.jsonl", "a", buffering=1)

    def train_step(self, batch: list[Rollout]) -> dict[str, float]:
        """One optimizer step over ``batch``, in token-budget micro-batches."""
        cfg = self.config.learner
        temperature = self.config.generator.temperature
        advantages = group_advantages([r.reward for r in batch], [r.group_id for r in batch])
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in batch]
        num_tokens = sum(len(r.response_ids) for r in batch)
        micro = _microbatches(lengths, cfg.max_tokens_per_microbatch)
        totals = defaultdict(float)
        self.engine.train()
        for k, rows in enumerate(micro):
            ids, attention, targets, behaviour, mask = _pack([batch[i] for i in rows])
            self.engine.set_gradient_accumulation_boundary(k == len(micro) - 1)
            logprobs, entropy = self.engine(ids, attention, targets, temperature)
            stats = ppo_clip_loss(logprobs, behaviour, advantages[rows], mask, entropy, cfg.clip_eps, num_tokens)
            self.engine.backward(stats.loss, scale_wrt_gas=False)
            self.engine.step()
            share = float(mask.sum()) / num_tokens
            totals["loss"] += stats.loss.item()
            for key in ("clip_fraction", "approx_kl", "entropy"):
                totals[key] += getattr(stats, key) * share
        grad_norm = self.engine.get_global_grad_norm()
        totals["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        totals["microbatches"] = len(micro)
        return dict(totals)

    def publish(self) -> float:
        """Export the current weights as the next version; returns seconds taken."""
        started = time.monotonic()
        update = weights.publish(
            gathered_parameters(self.model),
            version=self.version,
            weights_dir=self.weights_dir,
            model_dir=self.config.model.path,
            config_json=self._model_config_json,
            keep_versions=self.config.learner.keep_versions,
        )
        self.coordinator.publish(update)
        return time.monotonic() - started

    def run(self) -> dict:
        """Train for ``learner.total_steps`` steps; returns the run summary."""
        cfg = self.config.learner
        first_batch_s: float | None = None
        bar = tqdm(total=cfg.total_steps, desc="learner", disable=None, dynamic_ncols=True)
        while self.step < cfg.total_steps:
            wait_start = time.monotonic()
            batch = self.batcher.next_batch(cfg.groups_per_step, self.version)
            wait_s = time.monotonic() - wait_start
            first_batch_s = first_batch_s or time.monotonic()
            started = time.monotonic()
            stats = self.train_step(batch)
            step_s = time.monotonic() - started
            staleness = [self.version - r.oldest_version for r in batch]
            self._log_consumed(batch, staleness)
            self.step += 1
            publish_s = 0.0
            if self.step % cfg.publish_every_steps == 0:
                self.version += 1
                publish_s = self.publish()
            self.busy_s += step_s + publish_s
            reward = sum(r.reward for r in batch) / len(batch)
            self.last_reward = reward
            record = {
                "step": self.step,
                "version": self.version,
                "reward": reward,
                "samples": len(batch),
                "tokens": sum(len(r.response_ids) for r in batch),
                "response_len": sum(len(r.response_ids) for r in batch) / len(batch),
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "dropped_stale": self.bound.dropped["stale"],
                "step_s": step_s,
                "wait_s": wait_s,
                "publish_s": publish_s,
                "wall_s": time.monotonic() - first_batch_s,
                **stats,
            }
            record["samples_per_s"] = self.bound.consumed / max(record["wall_s"], 1e-9)
            self.metrics.write(record)
            bar.set_postfix(reward=f"{reward:.3f}", v=self.version, stale=f"{record['staleness_mean']:.2f}",
                            sps=f"{record['samples_per_s']:.0f}", refresh=False)
            bar.update(1)
        bar.close()
        return self._summary(time.monotonic() - (first_batch_s or time.monotonic()))

    def _log_consumed(self, batch: list[Rollout], staleness: list[int]) -> None:
        for rollout, s in zip(batch, staleness):
            self._consumed_log.write(json.dumps({"id": rollout.rollout_id, "step": self.step, "staleness": s,
                                                 "generator": rollout.generator_id}) + "\n")
        for rollout_id in self.batcher.dropped_ids:
            self._consumed_log.write(json.dumps({"id": rollout_id, "step": self.step, "dropped": "stale"}) + "\n")
        self.reader.ack([r.rollout_id for r in batch] + self.batcher.dropped_ids)
        self.batcher.dropped_ids.clear()

    def _summary(self, wall_s: float) -> dict:
        generators = list(self.coordinator.generators.values())
        generator_capacity = sum(g.samples_generated / g.busy_s for g in generators if g.busy_s > 0)
        learner_capacity = self.bound.consumed / self.busy_s if self.busy_s else 0.0
        achieved = self.bound.consumed / wall_s if wall_s else 0.0
        bottleneck = min(c for c in (generator_capacity, learner_capacity) if c > 0) if generators else 0.0
        return {
            "steps": self.step,
            "version": self.version,
            "max_staleness": self.bound.max_staleness,
            "wall_s": wall_s,
            "samples_consumed": self.bound.consumed,
            "samples_dropped": dict(self.bound.dropped),
            "achieved_samples_per_s": achieved,
            "learner_capacity_samples_per_s": learner_capacity,
            "generator_capacity_samples_per_s": generator_capacity,
            "pipeline_efficiency": achieved / bottleneck if bottleneck else 0.0,
            "rejected_messages": self.reader.rejected,
        }

    def status(self) -> Status:
        """A snapshot for ``asyncrl status``; called from the coordinator thread."""
        return Status(
            step=self.step,
            total_steps=self.config.learner.total_steps,
            version=self.version,
            max_staleness=self.bound.max_staleness,
            samples_consumed=self.bound.consumed,
            samples_dropped=dict(self.bound.dropped),
            samples_admitted=self.bound.admitted,
            buffer={k: float(v) for k, v in self.reader.stats().items()},
            generators=list(self.coordinator.generators.values()),
            reward=self.last_reward,
            started_s=self.started_s,
            now_s=now_s(),
        )


def _pack(rollouts: list[Rollout]):
    """Right-padded ``[rows, len]`` tensors; targets and masks cover response tokens only."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    rows = len(rollouts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    behaviour = torch.zeros(rows, width)
    mask = torch.zeros(rows, width)
    for row, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[row, : p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        attention[row, : p + n] = 1
        # Position t predicts token t + 1: the response is predicted from p - 1 on.
        targets[row, p - 1 : p + n - 1] = torch.tensor(r.response_ids)
        behaviour[row, p - 1 : p + n - 1] = torch.tensor(r.logprobs)
        mask[row, p - 1 : p + n - 1] = 1
    return ids, attention, targets, behaviour, mask
