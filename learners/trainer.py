"""The learner loop: get a batch, step, publish, record; checkpoint when due.

Rank 0 is the driver: it reads the buffer, runs the coordinator and decides
every step. It sends each step's :class:`StepOrder` (the batch, and whether
to checkpoint or stop) to all ranks, so the collectives of ZeRO-3 always
line up, and a SIGTERM seen by rank 0 becomes a checkpoint on every rank at
the same step. Each rank trains on its slice of the batch.

Each job has its module: the step's maths in :mod:`learners.step`, the
collectives across ranks in :mod:`learners.ranks`, rank 0's records and
acks in :mod:`learners.records`, evaluations in :mod:`learners.evals`,
what a checkpoint holds of this loop in :mod:`learners.resume`, and weight
publishing in :mod:`learners.publisher`.

Generators and learners never import each other; everything here speaks to
generators through the buffer (rollouts in) and the coordinator (tickets and
weight versions out).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from asyncrl.config import RunConfig
from asyncrl.control.coordinator import Coordinator
from asyncrl.observe import trace
from asyncrl.observe.logs import StallReport
from asyncrl.observe.metrics import MetricsWriter, reward_text
from asyncrl.weights import folders
from asyncrl.wire.protocol import Rollout, StepOrder, now_s
from asyncrl.wire.sockets import RequestServer
from buffers import RolloutReader
from learners.batcher import GroupBatcher
from learners.evals import Evaluations
from learners.publisher import Publisher
from learners.ranks import Ranks
from learners.records import Records, RewardWindow, StepTimes, token_staleness
from learners.report import RunView
from learners.resume import Checkpoints, groups_redone, loop_state, restore_loop, rewind_logs
from learners.rollout_sample import DropSample, RolloutSampler
from learners.step import PolicyStep

log = logging.getLogger(__name__)


@dataclass
class Driver:
    """What only rank 0 holds: the buffer, the coordinator and the run's outputs."""

    reader: RolloutReader
    coordinator: Coordinator
    metrics: MetricsWriter
    server: RequestServer | None = None  # the coordinator's endpoint, once it serves


def _quarters(max_new_tokens: int) -> tuple[int, ...]:
    """Response-length bucket edges: the quarters of ``generator.max_new_tokens``."""
    return tuple(sorted({max(1, max_new_tokens * q // 4) for q in (1, 2, 3, 4)}))


class Learner:
    """One rank of the learner group; rank 0 also drives (``driver`` is set)."""

    def __init__(
        self,
        config: RunConfig,
        engine,
        model: torch.nn.Module,
        rank: int,
        world_size: int,
        driver: Driver | None,
        reference=None,
        critic=None,
    ) -> None:
        self.config, self.driver = config, driver
        self.rank, self.world_size = rank, world_size
        self.ranks = Ranks.join(rank, world_size)
        self.maths = PolicyStep(config, engine, self.ranks, reference, critic)
        self.step = 0
        self.version = 0
        self.busy_s = 0.0
        self.trained_before_s = 0.0  # resumed: the run's training time up to its checkpoint (metrics' wall_s)
        self.first_batch_s: float | None = None  # this process's first batch
        self.stall = StallReport(config.learner.stall_report_s, log, "learner.stall_report_s")
        self.started_s = now_s()
        self.run_dir = Path(config.run_dir)
        self.weights_dir = Path(config.learner.weights_dir or self.run_dir / "weights")
        self.checkpoints = Checkpoints(
            engine, self.run_dir / "checkpoints", rank, config.learner.keep_checkpoints, critic
        )
        self._sigterm = False
        self._publish_at_start = False  # set by resume()
        self.publisher = Publisher(config, model, driver.coordinator if driver is not None else None, self.weights_dir)
        if driver is not None:
            self.batcher = GroupBatcher(
                driver.reader,
                driver.coordinator,
                config.learner.batch_timeout_s,
                should_stop=lambda: self._sigterm,
                on_wait=self._on_wait,
                skip_uniform=config.algo.dynamic_sampling,
                max_skip_rounds=config.algo.dynamic_sampling_max_rounds,
                length_edges=_quarters(config.generator.max_new_tokens),
                dropped_sample=DropSample(config.learner.rollout_samples_per_step),
            )
            self.records = Records(
                self.run_dir,
                driver,
                self.batcher,
                durable=config.buffer.type == "redis",
                unscored_steps_to_fail=config.task.unscored_steps_to_fail,
            )
            self.evals = Evaluations(driver.coordinator.evals, config.eval, self.run_dir, driver.metrics)
            learner = config.learner
            self.sample = RolloutSampler(self.run_dir, learner.rollout_samples_per_step, learner.rollout_sample_max_mb)
            self.view = RunView(config, driver, self.batcher, self.started_s)
            self.reward_window = RewardWindow(learner.stop_at_reward, learner.stop_window_steps)
            self.refresh_status(force=True)

    def install_sigterm_handler(self) -> None:
        """SIGTERM on rank 0 means: checkpoint at the next step boundary, then exit."""

        def handler(signum, frame):
            log.warning("SIGTERM: checkpointing and stopping after the current step")
            self._sigterm = True

        signal.signal(signal.SIGTERM, handler if self.rank == 0 else signal.SIG_IGN)

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> dict | None:
        """Train until ``learner.total_steps`` or ``learner.max_train_s`` (or SIGTERM); rank 0 returns the summary."""
        cfg = self.config.learner
        bar = tqdm(
            total=cfg.total_steps,
            initial=self.step,
            desc="learner",
            dynamic_ncols=True,
            disable=None if self.rank == 0 else True,
        )
        try:
            if self._publish_at_start:  # first: a resumed learner's generators must hear its version
                self._publish_at_start = False
                self.publish()
            if cfg.compile:
                with trace.span("compile"):
                    self.maths.compile_now()  # while the generators sample the first batch
            if self.driver is not None and self.step == 0:
                self.evals.start(self.version, self.step)  # the starting policy, for comparison
            while self.step < cfg.total_steps:
                order, wait_s = self._next_order()
                if order.stop:
                    self._stop(order)
                    return None
                if order.finish:
                    break
                self._train(order.batch, order.stale_peers, wait_s, bar)
                if order.checkpoint:
                    with trace.span("checkpoint"):
                        self.save_checkpoint()
            if cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps:
                self.save_checkpoint()  # the final state, and the acks that wait for it
        finally:
            bar.close()
            self.publisher.finish()  # the last version reaches the generators before the learner says stop
        return self._summary() if self.driver is not None else None

    def _next_order(self) -> tuple[StepOrder, float]:
        """Every rank: rank 0's order for the next step, and the seconds spent waiting for it."""
        wait_start = time.monotonic()
        try:
            with trace.span("wait_batch"):
                order = self.ranks.exchange(self._order() if self.driver is not None else None)
        except TimeoutError:
            self.ranks.exchange(StepOrder(batch=[], stop=True))
            raise
        return order, time.monotonic() - wait_start

    def _order(self) -> StepOrder:
        """Rank 0: the next step's batch, or the decision to stop or finish."""
        cfg = self.config.learner
        if self._sigterm:
            return StepOrder(batch=[], checkpoint=True, stop=True)
        if self.records.failure:
            return StepOrder(batch=[], stop=True)
        if cfg.max_train_s and self._trained_s() >= cfg.max_train_s:
            log.info("learner.max_train_s (%.0f s) spent after %d steps: finishing", cfg.max_train_s, self.step)
            return StepOrder(batch=[], finish=True)
        if self.reward_window.reached():
            log.info(
                "learner.stop_at_reward: the mean reward of the last %d steps reached %.3f after %d steps: finishing",
                cfg.stop_window_steps,
                self.reward_window.mean(),
                self.step,
            )
            return StepOrder(batch=[], finish=True)
        batch = self.batcher.next_batch(cfg.groups_per_step, self.version)
        if batch is None:
            return StepOrder(batch=[], checkpoint=True, stop=True)
        due = cfg.checkpoint_every_steps and (self.step + 1) % cfg.checkpoint_every_steps == 0
        return StepOrder(batch=batch, checkpoint=bool(due), stale_peers=self.batcher.stale_peers)

    def _stop(self, order: StepOrder) -> None:
        """Stop before the next step: checkpoint if asked, and say why if the run failed."""
        if order.checkpoint and self.step > 0:  # before the first step there is nothing to continue
            self.save_checkpoint()
        if self.driver is not None and self.records.failure:
            raise RuntimeError(self.records.failure)

    def _train(self, batch: list[Rollout], stale_peers: list[Rollout], wait_s: float, bar: tqdm) -> None:
        """One step of the loop: train on ``batch``, publish when due, and (rank 0) record it."""
        self.first_batch_s = self.first_batch_s or time.monotonic()
        started = time.monotonic()
        if self.driver is not None:
            self.maths.keep = self.sample.pick(batch)
        with self.stall.watch(f"learner step {self.step + 1}"):
            stats = self.maths.run(batch, stale_peers)
        step_s = time.monotonic() - started
        trained_at = self.version  # the version the batch was judged against (staleness, drops)
        staleness = [trained_at - r.oldest_version for r in batch]
        stats["token_staleness_mean"] = token_staleness(trained_at, batch)
        self.step += 1
        publish_s = self._publish_if_due()
        self.busy_s += step_s + publish_s
        if self.driver is not None:
            times = StepTimes(step_s, wait_s, publish_s, self.publisher.timings(), self._trained_s())
            with trace.span("record"):
                self._record(batch, staleness, stats, times, bar, trained_at)

    def _publish_if_due(self) -> float:
        """Publish the next version every ``learner.publish_every_steps``; returns the seconds it held the step."""
        if self.driver is not None:
            self.evals.stepped(self.step)
        if self.step % self.config.learner.publish_every_steps:
            return 0.0
        self.version += 1
        with trace.span("publish", version=self.version):
            publish_s = self.publish()
        if self.driver is not None:
            self.evals.published(self.version, self.step)
        return publish_s

    def _record(
        self, batch: list[Rollout], staleness: list[int], stats: dict, times: StepTimes, bar: tqdm, trained_at: int
    ) -> None:
        """Rank 0: the step's records, what status and /metrics show, and the progress bar. ``trained_at``: the
        learner's version when it trained the batch (the kept rollouts' ``version``; ``self.version`` may be the
        one the step published since)."""
        record = self.records.metrics(self.step, self.version, batch, staleness, stats, times)
        self.view.last_record = record  # replaced whole: the metrics endpoint reads it from its own thread
        self.reward_window.add(record["reward"])
        self.evals.collect()
        self.refresh_status()
        self.records.consumed(self.step, batch, staleness)
        self.sample.write(
            self.step, trained_at, batch, staleness, self.maths.last_advantages, self.maths.learner_logprobs
        )
        self.sample.write_dropped(self.step, trained_at, self.batcher.dropped_sample.take())
        bar.set_postfix(
            reward=reward_text(record["reward"]),
            v=self.version,
            stale=f"{record['staleness_mean']:.2f}",
            sps=f"{record['samples_per_s']:.0f}",
            refresh=False,
        )
        bar.update(1)

    def _summary(self) -> dict:
        """Rank 0, at the end: the final evaluation, then ``summary.json``."""
        wall_s = self._trained_s()
        self.evals.final(self.version, self.step, self.refresh_status)
        return self.view.summary(
            step=self.step,
            version=self.version,
            world_size=self.world_size,
            wall_s=wall_s,
            busy_s=self.busy_s,
            left_over=self._left_over(),
            evaluation=self.evals.summary(),
        )

    def _left_over(self) -> int:
        """Stop handing out work, then count every rollout that arrives and will not be trained on."""
        coordinator = self.driver.coordinator
        coordinator.stop()
        return self.batcher.left_over(
            limit_s=self.config.coordinator.timeout_s, generators_done=lambda: not coordinator.generators_not_stopped()
        )

    def _trained_s(self) -> float:
        """The run's training time: since this process's first batch, plus, resumed, the time up to the
        checkpoint."""
        since = time.monotonic() - self.first_batch_s if self.first_batch_s is not None else 0.0
        return self.trained_before_s + since

    # --- around the loop --------------------------------------------------------------------------

    def publish(self) -> float:
        """Publish the current weights as version ``self.version``; returns seconds taken."""
        return self.publisher.publish(self.version)

    def refresh_status(self, force: bool = False) -> None:
        """Rank 0's main thread: hand the latest state to what status and /metrics read."""
        self.view.refresh(self.step, self.version, self.records.last_reward, len(self.records.unacked), force)

    def _on_wait(self) -> bool:
        """Rank 0, about once a second while no group is ready."""
        self.refresh_status()
        self.evals.collect()
        return self.publisher.resend_if_lagging()

    def save_checkpoint(self) -> None:
        """A checkpoint of this step on every rank, unless one was saved (or resumed from) at this step already;
        rank 0 then acknowledges what waited for it."""
        if not self.checkpoints.due(self.step):
            return
        state = None
        if self.driver is not None:
            unfinished = self.evals.unfinished(self.step)
            state = loop_state(self.step, self.version, self.driver.coordinator, self.batcher, unfinished)
        self.checkpoints.save(self.step, state)
        if self.driver is not None:
            self.records.checkpointed()

    def resume(self) -> None:
        """Continue from the newest checkpoint in ``run_dir/checkpoints``."""
        state = self.checkpoints.load()
        self.step, self.version = state.step, state.version
        if self.driver is not None:
            durable = self.records.ack_at_checkpoint
            restore_loop(state, self.driver.coordinator, self.batcher, reissue=not durable)
            redone = groups_redone(state)
            history = rewind_logs(self.run_dir, self.step, durable, self.batcher, self.driver.metrics, redone)
            self.trained_before_s, self.busy_s = history.trained_s, history.busy_s
            self.records.last_reward = history.last_reward
            self.evals.results = history.eval_results
            self.evals.resume(state.evals, self.version)  # what the run stopped before it was answered
            folders.discard_after(self.weights_dir, self.version)
        # Generators may hold a version from after the checkpoint, or this very number with the weights of a later
        # step: announce ours again, v0 included (WeightUpdate.session tells the two apart). A push needs
        # generators to hear of it, so it waits for run(), when the coordinator serves.
        if self.publisher.transport == "push":
            self._publish_at_start = True
        else:
            self.publish()
