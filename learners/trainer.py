"""The learner loop: assemble groups, enforce staleness, step, publish, checkpoint.

Rank 0 is the driver: it reads the buffer, runs the coordinator and decides
every step. It sends each step's :class:`StepOrder` (the batch, and whether
to checkpoint or stop) to all ranks, so the collectives of ZeRO-3 always
line up, and a SIGTERM seen by rank 0 becomes a checkpoint on every rank at
the same step. Each rank trains on its slice of the batch.

Generators and learners never import each other; everything here speaks to
generators through the buffer (rollouts in) and the coordinator (tickets and
weight versions out).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from tqdm import tqdm

from asyncrl.config import RunConfig
from asyncrl.control.coordinator import Coordinator
from asyncrl.control.evaluation import write_result
from asyncrl.observe import trace
from asyncrl.observe.logs import StallReport
from asyncrl.observe.metrics import MetricsWriter, in_step_order, read_jsonl, read_metrics, reward_text
from asyncrl.weights import folders
from asyncrl.wire.protocol import Rollout, StepOrder, now_s
from asyncrl.wire.sockets import RequestServer
from buffers import RolloutReader
from learners import checkpoint
from learners.algo import gae_targets, loss_config, step_advantages
from learners.batcher import GroupBatcher, RecentIds
from learners.critic import value_loss
from learners.engine import grad_norm_of
from learners.packing import microbatches, pack, place, response_values
from learners.policy_loss import LossCounts, kl_penalty, policy_loss
from learners.publisher import Publisher
from learners.report import RunView

log = logging.getLogger(__name__)


@dataclass
class Driver:
    """What only rank 0 holds: the buffer, the coordinator and the run's outputs."""

    reader: RolloutReader
    coordinator: Coordinator
    metrics: MetricsWriter
    server: RequestServer | None = None  # the coordinator's endpoint, once it serves


def explained_variance(
    batch: list[Rollout], values: list[torch.Tensor], returns: list[torch.Tensor]
) -> dict[str, float]:
    """How much of the returns' variance the critic's values (before the step) explain, and their mean.

    Rollouts whose reward failed are left out: their targets are their own values, which would read as a
    perfect critic.
    """
    scored = [i for i, rollout in enumerate(batch) if not rollout.reward_failed]
    if not scored:  # every reward of the step failed: nothing for the critic to explain
        return {"value_mean": 0.0, "value_explained_var": 0.0}
    v, r = torch.cat([values[i] for i in scored]).float(), torch.cat([returns[i] for i in scored]).float()
    var = float(r.var(unbiased=False)) if r.numel() > 1 else 0.0
    explained = 1 - float((r - v).var(unbiased=False)) / var if var > 0 else 0.0
    return {"value_mean": float(v.mean()) if v.numel() else 0.0, "value_explained_var": explained}


def interleave(shards: list[list]) -> list:
    """Undo ``batch[rank::world_size]``: rank r's j-th item is the batch's item ``r + j * world_size``."""
    out = [None] * sum(len(shard) for shard in shards)
    for rank, shard in enumerate(shards):
        out[rank :: len(shards)] = shard
    return out


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
        if not isinstance(config.learner.pack_sequences, bool):
            raise ValueError(
                "learner.pack_sequences auto is settled when the engine is built "
                "(learners.engine.resolve_packing), before the learner starts"
            )
        self.config = config
        self.engine = engine
        # DeepSpeed reports the gradient norm where ZeRO or a bf16/fp16 optimizer clips; for fp32 without
        # ZeRO (one CPU rank by default) the learner measures it before the step.
        self._norm_of_module_grads = not (
            engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled()
        )
        self.reference = reference  # frozen starting policy, when algo.kl_coef > 0
        self.critic = critic  # the value model's engine, when algo.advantage is gae
        self.loss = loss_config(config.algo)
        self.model = model
        self.rank, self.world_size = rank, world_size
        self.driver = driver
        self.step = 0
        self.version = 0
        self.busy_s = 0.0
        self.trained_before_s = 0.0  # resumed: the run's training time up to its checkpoint (metrics' wall_s)
        self.stall = StallReport(config.learner.stall_report_s, log, "learner.stall_report_s")
        self.last_reward: float | None = None
        self._unscored_steps = 0  # steps in a row with no reward scored, before any step had one
        self._failure: str | None = None  # rank 0: why the run must stop (every reward failing from the start)
        self.started_s = now_s()
        self.run_dir = Path(config.run_dir)
        self.weights_dir = Path(config.learner.weights_dir or self.run_dir / "weights")
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self._sigterm = False
        self._publish_at_start = False  # set by resume()
        # Orders travel over gloo even when the engine uses NCCL: they are small and host-side.
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        # A durable buffer is acknowledged only once a checkpoint holds the steps
        # that used its rollouts, so a crash before then redelivers them.
        self._ack_at_checkpoint = config.buffer.type == "redis"
        self._unacked: list[str] = []
        self._saved_step: int | None = None  # the step of the newest checkpoint saved or resumed from
        self.evals = driver.coordinator.evals if driver is not None else None
        self.eval_results: list[dict] = []
        self.publisher = Publisher(config, model, driver.coordinator if driver is not None else None, self.weights_dir)
        if driver is not None:
            self.bound = driver.coordinator.bound
            self.batcher = GroupBatcher(
                driver.reader,
                driver.coordinator,
                config.learner.batch_timeout_s,
                should_stop=lambda: self._sigterm,
                on_wait=self._on_wait,
                skip_uniform=config.algo.dynamic_sampling,
                max_skip_rounds=config.algo.dynamic_sampling_max_rounds,
                length_edges=_quarters(config.generator.max_new_tokens),
            )
            self._consumed_log = open(self.run_dir / "consumed.jsonl", "a", buffering=1)
            # With ZeroMQ a drop is final; with Redis it is acknowledged at the next checkpoint, and one after
            # the checkpoint a resumed learner reads is delivered to it again (resume() cuts the log back).
            self._dropped_log = open(self.run_dir / "dropped.jsonl", "a", buffering=1)
            self.view = RunView(config, driver, self.batcher, self.started_s)
            self.refresh_status(force=True)

    def install_sigterm_handler(self) -> None:
        """SIGTERM on rank 0 means: checkpoint at the next step boundary, then exit."""

        def handler(signum, frame):
            log.warning("SIGTERM: checkpointing and stopping after the current step")
            self._sigterm = True

        signal.signal(signal.SIGTERM, handler if self.rank == 0 else signal.SIG_IGN)

    # --- one step ---------------------------------------------------------------------------

    def train_step(
        self,
        shard: list[Rollout],
        num_tokens: int,
        num_sequences: int,
        advantages: list[torch.Tensor],
        critic_targets: tuple[list, list] | None = None,
        token_kl: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over this rank's ``shard`` (with its per-token ``advantages``), in micro-batches.

        ``num_tokens`` and ``num_sequences`` count response tokens and non-empty
        responses over the whole batch (all ranks): DeepSpeed averages gradients
        over ranks, so normalising each rank's loss by ``count / world_size``
        yields the aggregate of the whole batch. ``critic_targets`` (old values,
        returns; per token of each rollout) train the critic in the same micro-batches.
        ``token_kl`` (``algo.kl_in: reward``): each rollout's KL to the reference,
        measured by :meth:`reward_kl` under these weights, reported as ``kl_ref``
        instead of running the reference again.
        """
        cfg = self.config.learner
        micro = microbatches(
            [len(r.prompt_ids) + len(r.response_ids) for r in shard], cfg.max_tokens_per_microbatch, cfg.pack_sequences
        )
        count = self._max_over_ranks(len(micro))  # every rank must run the same collectives
        totals: dict[str, float] = defaultdict(float)
        counts = LossCounts()
        module_grad_norm = None
        self.engine.train()
        for k in range(count):
            rows = micro[k] if k < len(micro) else []
            packed = pack([shard[i] for i in rows], cfg.pack_sequences, [advantages[i] for i in rows])
            device = self.engine.device  # DeepSpeed leaves moving the inputs to the caller
            ids, attention, positions, targets, behaviour, mask, adv = (
                t.to(device, non_blocking=True) if t is not None else None for t in packed
            )
            self.engine.set_gradient_accumulation_boundary(k == count - 1)
            temperature = self.config.generator.temperature
            reference = reference_kl = None
            if token_kl is not None:
                reference_kl = place([shard[i] for i in rows], cfg.pack_sequences, [token_kl[i] for i in rows]).to(
                    device
                )
            elif self.reference is not None:
                with torch.no_grad(), trace.span("reference_forward"):
                    reference, _ = self.reference(ids, attention, targets, temperature, positions)
            with trace.span("forward", rows=int(ids.shape[0]), tokens=int(ids.numel())):
                logprobs, entropy = self.engine(
                    ids, attention, targets, temperature, positions, entropy_grad=self.loss.entropy_coef > 0
                )
            # Packed rows hold several rollouts: their positions restart at 0 at each one.
            segments = (positions == 0).long().cumsum(-1) - 1 if positions is not None else None
            stats = policy_loss(
                logprobs,
                behaviour,
                adv,
                mask,
                self.loss,
                num_tokens=max(num_tokens, 1) / self.world_size,
                num_sequences=max(num_sequences, 1) / self.world_size,
                horizon=self.config.generator.max_new_tokens,
                reference_logprobs=reference,
                reference_kl=reference_kl,
                entropy=entropy,
                segment_ids=segments,
            )
            with trace.span("backward"):
                self.engine.backward(stats.loss, scale_wrt_gas=False)
            if k == count - 1 and self._norm_of_module_grads:
                module_grad_norm = grad_norm_of(self.engine.module)
            with trace.span("optimizer_step"):
                self.engine.step()
            totals["loss"] += stats.loss.item() / self.world_size
            if critic_targets is not None:
                totals["value_loss"] += self._critic_step(
                    shard, rows, critic_targets, mask, k == count - 1, (ids, attention, positions), num_tokens
                )
            counts = counts + stats.counts
        counts = self._merge_over_ranks(totals, counts)
        totals.update(counts.summary())
        grad_norm = module_grad_norm if self._norm_of_module_grads else self.engine.get_global_grad_norm()
        totals["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        totals["microbatches"] = count
        return dict(totals)

    def _critic_step(self, shard, rows, targets: tuple[list, list], mask, boundary: bool, inputs, num_tokens) -> float:
        """One critic micro-batch: clipped value loss against the GAE returns, in the policy's micro-batches."""
        old_values, returns = targets
        rollouts, packed, device = [shard[i] for i in rows], self.config.learner.pack_sequences, self.critic.device
        old = place(rollouts, packed, [old_values[i] for i in rows]).to(device)
        ret = place(rollouts, packed, [returns[i] for i in rows]).to(device)
        self.critic.set_gradient_accumulation_boundary(boundary)
        values = self.critic(*inputs)
        loss = value_loss(values, old, ret, mask, self.config.algo.value_clip, max(num_tokens, 1) / self.world_size)
        self.critic.backward(loss, scale_wrt_gas=False)
        self.critic.step()
        return loss.item() / self.world_size

    def _per_token_pass(self, shard: list[Rollout], score) -> list[torch.Tensor]:
        """``score(ids, attention, targets, positions)`` (``[rows, T]``) of each rollout's response tokens, no grad.

        Laid out as training lays out its micro-batches (packed or padded rows), so
        the reference's and the critic's passes cost what the policy's forward does.
        """
        cfg = self.config.learner
        micro = microbatches(
            [len(r.prompt_ids) + len(r.response_ids) for r in shard], cfg.max_tokens_per_microbatch, cfg.pack_sequences
        )
        out: list[torch.Tensor] = [torch.zeros(0)] * len(shard)
        with torch.no_grad():
            for k in range(self._max_over_ranks(len(micro))):  # every rank runs the same collectives
                rollouts = [shard[i] for i in micro[k]] if k < len(micro) else []
                ids, attention, positions, targets, _, mask, _ = (
                    t.to(self.engine.device) if t is not None else None for t in pack(rollouts, cfg.pack_sequences)
                )
                values = score(ids, attention, targets, positions).float().cpu()
                for i, value in zip(micro[k] if rollouts else [], response_values(values, mask.cpu(), rollouts)):
                    out[i] = value
        return out

    def reward_kl(self, shard: list[Rollout]) -> list[torch.Tensor]:
        """Per-token KL(policy || reference) of each of this rank's rollouts, under the weights before the step.

        REINFORCE++ and GAE fold it into the returns, the group estimators into the
        reward (``algo.kl_in: reward``); it costs one forward pass of the policy
        and one of the reference, without gradients, and the step reports it as
        ``kl_ref``.
        """
        temperature = self.config.generator.temperature

        def score(ids, attention, targets, positions):
            reference, _ = self.reference(ids, attention, targets, temperature, positions)
            policy, _ = self.engine(ids, attention, targets, temperature, positions)
            return kl_penalty(policy, reference, self.config.algo.kl_estimator)

        return self._per_token_pass(shard, score)

    def critic_values(self, shard: list[Rollout]) -> list[torch.Tensor]:
        """The critic's value at each response token of this rank's rollouts, before the step."""
        return self._per_token_pass(
            shard, lambda ids, attention, targets, positions: self.critic(ids, attention, positions)
        )

    def _gather_shards(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's ``batch[rank::world_size]`` values (1-D float tensors on the CPU), back in batch order.

        Sent as tensors, each rank's values end to end with their lengths, never as pickled objects.
        """
        if self._group is None:
            return mine
        lengths = torch.tensor([len(v) for v in mine], dtype=torch.int64)
        values = torch.cat(mine).float() if mine else torch.zeros(0)
        sizes = self._all_gather(torch.tensor([len(mine), len(values)]))
        all_lengths = self._all_gather(lengths, max(int(size[0]) for size in sizes))
        all_values = self._all_gather(values, max(int(size[1]) for size in sizes))
        return interleave(
            [
                list(all_values[r][: int(sizes[r][1])].split(all_lengths[r][: int(sizes[r][0])].tolist()))
                for r in range(self.world_size)
            ]
        )

    def _all_gather(self, tensor: torch.Tensor, size: int | None = None) -> list[torch.Tensor]:
        """Every rank's ``tensor``, padded with zeros to ``size`` elements first (all_gather takes equal sizes)."""
        if size is not None:
            tensor = torch.nn.functional.pad(tensor, (0, size - len(tensor)))
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self._group)
        return out

    def _over_ranks(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        if self._group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self._group)
        return t.tolist()

    def _max_over_ranks(self, value: int) -> int:
        return int(self._over_ranks([value], dist.ReduceOp.MAX)[0])

    def _merge_over_ranks(self, totals: dict[str, float], counts: LossCounts) -> LossCounts:
        """The step's losses (``totals``, each rank's share in place) and statistics over every rank, not rank 0's."""
        losses = [key for key in ("loss", "value_loss") if key in totals]
        sums = [f.name for f in fields(LossCounts) if f.name != "is_ratio_max"]
        merged = self._over_ranks([totals[key] for key in losses] + [getattr(counts, name) for name in sums])
        totals.update(zip(losses, merged))
        return LossCounts(
            **dict(zip(sums, merged[len(losses) :])),
            is_ratio_max=self._over_ranks([counts.is_ratio_max], dist.ReduceOp.MAX)[0],
        )

    def _exchange(self, order: StepOrder | None) -> StepOrder:
        """Rank 0's order, delivered to every rank (msgspec bytes over gloo)."""
        if self._group is None:
            return order
        data = msgspec.msgpack.encode(order) if self.rank == 0 else b""
        size = torch.tensor([len(data)])
        dist.broadcast(size, src=0, group=self._group)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        dist.broadcast(buffer, src=0, group=self._group)
        return order if self.rank == 0 else msgspec.msgpack.decode(buffer.numpy().tobytes(), type=StepOrder)

    def publish(self) -> float:
        """Publish the current weights as version ``self.version``; returns seconds taken."""
        return self.publisher.publish(self.version)

    def _on_wait(self) -> bool:
        """Rank 0, about once a second while no group is ready."""
        self.refresh_status()
        self._collect_evals()
        return self.publisher.resend_if_lagging()

    # --- the loop -----------------------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest checkpoint in ``run_dir/checkpoints``."""
        state = checkpoint.load(self.engine, self.checkpoint_dir, self.rank)
        if self.critic is not None:
            folder = self.checkpoint_dir / checkpoint.tag_of(state.step)
            path, _ = self.critic.load_checkpoint(str(folder), tag="critic")
            if path is None:
                raise RuntimeError(f"--resume: no critic state in {folder}")
        self.step, self.version = state.step, state.version
        self._saved_step = state.step
        if self.driver is not None:
            self.bound.restore(state.bound)  # first: restoring the coordinator may release tickets
            self.driver.coordinator.restore(state.coordinator, reissue=self.config.buffer.type != "redis")
            self.batcher.consumed_ids = RecentIds(state.consumed_ids)
            self.batcher.by_length.update((bucket, Counter(verdicts)) for bucket, verdicts in state.by_length.items())
            # The run's drops are dropped.jsonl's records, up to a line torn by a crash mid-write. With ZeroMQ a
            # drop is final; with Redis those after the checkpoint were never acknowledged, and come again.
            durable = self._ack_at_checkpoint
            checkpoint.truncate_log(
                self.run_dir / "dropped.jsonl", self.step if durable else sys.maxsize, ordered=durable
            )
            self.batcher.drops.update(r["reason"] for r in read_jsonl(self.run_dir / "dropped.jsonl"))
            # Steps after the checkpoint were undone: so are their records, their evaluations and TensorBoard's
            # points. Clocks go on from the checkpoint's step (the time the learner was down is not counted).
            for name in ("metrics.jsonl", "consumed.jsonl"):
                checkpoint.truncate_log(self.run_dir / name, self.step)
            checkpoint.truncate_log(self.run_dir / "eval.jsonl", self.step, ordered=False)
            self.driver.metrics.resume_at(self.step)
            records = read_metrics(self.run_dir)
            self.trained_before_s = records[-1]["wall_s"] if records else 0.0
            self.busy_s = sum(r["step_s"] + r.get("publish_s", 0.0) for r in records)
            # A run that scored rewards before is past its start: a reward server slow to come back after the
            # restart is an outage (task.unscored_steps_to_fail guards the start only).
            self.last_reward = next((r["reward"] for r in reversed(records) if r.get("reward") is not None), None)
            self.eval_results = read_jsonl(self.run_dir / "eval.jsonl")
        if self.driver is not None:
            folders.discard_after(self.weights_dir, self.version)
        # Generators may hold a version from after the checkpoint, or this very number with the weights of a later
        # step: announce ours again, v0 included (WeightUpdate.session tells the two apart). A push needs
        # generators to hear of it, so it waits for run(), when the coordinator serves.
        if self.publisher.transport == "push":
            self._publish_at_start = True
        else:
            self.publish()

    def save_checkpoint(self) -> None:
        """A checkpoint of this step, unless one was saved (or resumed from) at this step already: a stop right
        after a periodic checkpoint keeps that one, as a crash there would (what arrived since, drops and
        groups held, comes again from a durable buffer or is generated again)."""
        if self.step == self._saved_step:
            return
        state = None
        if self.driver is not None:
            tickets = self.driver.coordinator.state()
            tickets.outstanding += self.batcher.held_tickets()
            state = checkpoint.LearnerState(
                step=self.step,
                version=self.version,
                coordinator=tickets,
                bound=self.bound.state(),
                consumed_ids=list(self.batcher.consumed_ids),  # oldest first
                by_length={bucket: dict(verdicts) for bucket, verdicts in self.batcher.by_length.items()},
            )
        checkpoint.save(
            self.engine,
            self.checkpoint_dir,
            self.step,
            state,
            self.rank,
            self.config.learner.keep_checkpoints,
            critic=self.critic,
        )
        self._saved_step = self.step
        if self.driver is not None and self._unacked:
            self.driver.reader.ack(self._unacked)
            self._unacked = []

    def _order(self, first_batch_s: float | None) -> StepOrder:
        """Rank 0: the next step's batch, or the decision to stop or finish."""
        cfg = self.config.learner
        if self._sigterm:
            return StepOrder(batch=[], checkpoint=True, stop=True)
        if self._failure:
            return StepOrder(batch=[], stop=True)
        if cfg.max_train_s and self._trained_s(first_batch_s) >= cfg.max_train_s:
            log.info("learner.max_train_s (%.0f s) spent after %d steps: finishing", cfg.max_train_s, self.step)
            return StepOrder(batch=[], finish=True)
        batch = self.batcher.next_batch(cfg.groups_per_step, self.version)
        if batch is None:
            return StepOrder(batch=[], checkpoint=True, stop=True)
        due = cfg.checkpoint_every_steps and (self.step + 1) % cfg.checkpoint_every_steps == 0
        return StepOrder(batch=batch, checkpoint=bool(due), stale_peers=self.batcher.stale_peers)

    def run(self) -> dict | None:
        """Train until ``learner.total_steps`` or ``learner.max_train_s`` (or SIGTERM); rank 0 returns the summary."""
        cfg = self.config.learner
        first_batch_s: float | None = None
        eval_owed = False
        bar = tqdm(
            total=cfg.total_steps,
            initial=self.step,
            desc="learner",
            dynamic_ncols=True,
            disable=None if self.rank == 0 else True,
        )
        try:
            if self._publish_at_start:
                self._publish_at_start = False
                self.publish()
            if self.evals is not None and self.step == 0:
                self.evals.schedule(self.version, self.step)  # the starting policy, for comparison
            while self.step < cfg.total_steps:
                wait_start = time.monotonic()
                try:
                    with trace.span("wait_batch"):
                        order = self._exchange(self._order(first_batch_s) if self.driver is not None else None)
                except TimeoutError:
                    self._exchange(StepOrder(batch=[], stop=True))
                    raise
                wait_s = time.monotonic() - wait_start
                if order.stop:
                    if order.checkpoint and self.step > 0:  # before the first step there is nothing to continue
                        self.save_checkpoint()
                    if self._failure:
                        raise RuntimeError(self._failure)
                    return None
                if order.finish:
                    break
                first_batch_s = first_batch_s or time.monotonic()
                batch = order.batch
                started = time.monotonic()
                num_tokens = sum(len(r.response_ids) for r in batch)
                num_sequences = sum(1 for r in batch if r.response_ids)
                # Groups are normalised whole, before the batch is split across ranks.
                mine = slice(self.rank, None, self.world_size)
                algo, max_new_tokens = self.config.algo, self.config.generator.max_new_tokens
                with self.stall.watch(f"learner step {self.step + 1}"):
                    token_kl = self._gather_shards(self.reward_kl(batch[mine])) if algo.kl_in == "reward" else None
                    critic_targets = None
                    with trace.span("advantages"):
                        if self.critic is not None:
                            values = self._gather_shards(self.critic_values(batch[mine]))
                            advantages, returns = gae_targets(batch, algo, max_new_tokens, values, token_kl)
                            critic_targets = (values[mine], returns[mine])
                        else:
                            advantages = step_advantages(batch, algo, max_new_tokens, token_kl, order.stale_peers)
                    stats = self.train_step(
                        batch[mine],
                        num_tokens,
                        num_sequences,
                        advantages[mine],
                        critic_targets,
                        token_kl[mine] if token_kl is not None else None,
                    )
                if critic_targets is not None:
                    stats.update(explained_variance(batch, values, returns))
                step_s = time.monotonic() - started
                staleness = [self.version - r.oldest_version for r in batch]
                self.step += 1
                # An evaluation falls due at a step and evaluates the first version published from then on.
                eval_owed = eval_owed or (self.evals is not None and self.evals.due(self.step))
                publish_s = 0.0
                if self.step % cfg.publish_every_steps == 0:
                    self.version += 1
                    with trace.span("publish", version=self.version):
                        publish_s = self.publish()
                    if eval_owed:
                        self.evals.schedule(self.version, self.step)
                        eval_owed = False
                self.busy_s += step_s + publish_s
                if self.driver is not None:
                    with trace.span("record"):
                        self._record(batch, staleness, stats, step_s, wait_s, publish_s, first_batch_s, bar)
                if order.checkpoint:
                    with trace.span("checkpoint"):
                        self.save_checkpoint()
            if cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps:
                self.save_checkpoint()  # the final state, and the acks that wait for it
        finally:
            bar.close()
            self.publisher.finish()  # the last version reaches the generators before the learner says stop
        if self.driver is None:
            return None
        wall_s = self._trained_s(first_batch_s)
        self._final_evaluation()
        return self.view.summary(
            step=self.step,
            version=self.version,
            world_size=self.world_size,
            wall_s=wall_s,
            busy_s=self.busy_s,
            left_over=self._left_over(),
            evaluation=self._eval_summary(),
        )

    def _left_over(self) -> int:
        """Stop handing out work, then count every rollout that arrives and will not be trained on."""
        coordinator = self.driver.coordinator
        coordinator.stop()
        return self.batcher.left_over(
            limit_s=self.config.coordinator.timeout_s, generators_done=lambda: not coordinator.generators_not_stopped()
        )

    def refresh_status(self, force: bool = False) -> None:
        """Rank 0's main thread: hand the latest state to what status and /metrics read."""
        self.view.refresh(self.step, self.version, self.last_reward, len(self._unacked), force)

    # --- evaluation (rank 0) ------------------------------------------------------------------

    def _final_evaluation(self) -> None:
        """Evaluate the last version (unless it was already) and wait for what is still out, within a bound."""
        if self.evals is None:
            return
        if self.version not in {r["version"] for r in self.eval_results}:  # before a resume, perhaps
            self.evals.schedule(self.version, self.step)
        deadline = time.monotonic() + self.config.eval.final_timeout_s
        while self.evals.pending() and time.monotonic() < deadline:
            time.sleep(0.2)
            self.refresh_status()
        if self.evals.pending():
            log.warning("%d evaluations unfinished after eval.final_timeout_s", self.evals.pending())
        self._collect_evals()

    def _collect_evals(self) -> None:
        """Rank 0's main thread: write finished evaluations (traces, scores, TensorBoard)."""
        if self.evals is None:
            return
        for result in self.evals.finished():
            write_result(self.run_dir, result)
            self.driver.metrics.scalars(
                {"eval/pass@1": result.pass_at_1, f"eval/pass@{result.k}": result.pass_at_k}, result.step
            )
            self.eval_results.append(result.record())
            log.info(
                "eval of v%d (step %d): pass@1 %.3f, pass@%d %.3f on %d prompts",
                result.version,
                result.step,
                result.pass_at_1,
                result.k,
                result.pass_at_k,
                result.num_prompts,
            )

    def _eval_summary(self) -> dict:
        if not self.eval_results:
            return {}
        k = self.config.eval.k
        results = in_step_order(self.eval_results)
        ones = [r["pass@1"] for r in results]
        ks = [r[f"pass@{k}"] for r in results]
        return {
            "pass@1_start": ones[0],
            "pass@1_best": max(ones),
            "pass@1_final": ones[-1],
            f"pass@{k}_start": ks[0],
            f"pass@{k}_best": max(ks),
            f"pass@{k}_final": ks[-1],
            "evaluations": len(results),
            "prompts": results[-1]["prompts"],
        }

    def _note_unscored_step(self) -> None:
        """Another step, since the start, on which every reward failed: past ``task.unscored_steps_to_fail`` the
        run stops, naming the failures, instead of training on advantages of 0 for its whole budget."""
        self._unscored_steps += 1
        limit = self.config.task.unscored_steps_to_fail
        if not limit or self._unscored_steps < limit:
            return
        failures = Counter()
        for generator in self.driver.coordinator.generator_list():
            failures.update(generator.reward_failures)
        why = ", ".join(f"{reason}: {count}" for reason, count in failures.most_common()) or "see the generator logs"
        self._failure = (
            f"no reward was scored in the first {self._unscored_steps} steps: every reward failed "
            f"({why}); check task.reward / task.rewards and the generator logs, which name the error "
            "(task.unscored_steps_to_fail: 0 trains on all the same)"
        )

    def _trained_s(self, first_batch_s: float | None) -> float:
        """The run's training time: since this process's first batch, plus, resumed, the time up to the
        checkpoint."""
        return self.trained_before_s + (time.monotonic() - first_batch_s if first_batch_s is not None else 0.0)

    def _record(self, batch, staleness, stats, step_s, wait_s, publish_s, first_batch_s, bar) -> None:
        batcher = self.batcher
        scored = [r.reward for r in batch if not r.reward_failed]
        reward = sum(scored) / len(scored) if scored else None  # a failed reward is not a wrong answer
        if reward is not None:
            self.last_reward = reward
        elif self.last_reward is None:
            self._note_unscored_step()
        wall_s = self._trained_s(first_batch_s)
        record = {
            "step": self.step,
            "version": self.version,
            "reward": reward,
            "reward_failed": sum(r.reward_failed for r in batch),  # left out of reward and of advantages
            "samples": len(batch),
            "tokens": sum(len(r.response_ids) for r in batch),
            "response_len": sum(len(r.response_ids) for r in batch) / len(batch),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "dropped_stale": self.bound.dropped["stale"],
            "step_s": step_s,
            "wait_s": wait_s,
            # wait_s by cause: generation behind, the buffer's own work, housekeeping, and the rest
            # (assembling groups, staleness checks, handing the order to other ranks).
            "wait_rollouts_s": batcher.wait_rollouts_s,
            "wait_buffer_s": batcher.buffer_s,
            "wait_housekeeping_s": batcher.housekeeping_s,
            "wait_other_s": max(0.0, wait_s - batcher.wait_rollouts_s - batcher.buffer_s - batcher.housekeeping_s),
            "publish_s": publish_s,
            **({"push_s": self.publisher.last_push_s} if self.publisher.last_push_s is not None else {}),
            **({"publish_write_s": self.publisher.last_write_s} if self.publisher.last_write_s is not None else {}),
            "wall_s": wall_s,
            "samples_per_s": self.bound.consumed / max(wall_s, 1e-9),
            **stats,
        }
        self.driver.metrics.write(record)
        self.view.last_record = record  # replaced whole: the metrics endpoint reads it from its own thread
        self._collect_evals()
        batcher.buffer_s = batcher.wait_rollouts_s = batcher.housekeeping_s = 0.0
        self.refresh_status()
        self._log_consumed(batch, staleness)
        bar.set_postfix(
            reward=reward_text(reward),
            v=self.version,
            stale=f"{record['staleness_mean']:.2f}",
            sps=f"{record['samples_per_s']:.0f}",
            refresh=False,
        )
        bar.update(1)

    def _log_consumed(self, batch: list[Rollout], staleness: list[int]) -> None:
        lines = [
            json.dumps(
                {
                    "id": r.rollout_id,
                    "step": self.step,
                    "staleness": s,
                    "prompt": r.prompt_index,
                    "generator": r.generator_id,
                }
            )
            for r, s in zip(batch, staleness)
        ]
        self._consumed_log.write("".join(line + "\n" for line in lines))
        drops = [json.dumps({"id": i, "step": self.step, "reason": why}) for i, why in self.batcher.dropped]
        self._dropped_log.write("".join(line + "\n" for line in drops))
        self.batcher.consumed_ids.update(r.rollout_id for r in batch)
        done = [r.rollout_id for r in batch] + [i for i, _ in self.batcher.dropped]
        if self._ack_at_checkpoint:
            # Drops wait for the checkpoint too: a group's stale members are dropped beside its members trained
            # on, and after a crash before the checkpoint its ticket is out again and needs every member back.
            self._unacked += done
            done = []
        self.driver.reader.ack(done)
        self.batcher.dropped.clear()
