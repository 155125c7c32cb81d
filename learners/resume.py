"""What a checkpoint holds of the learner loop's state, and how a resumed learner takes it back.

The files themselves (DeepSpeed state, RNG, ``LATEST``) are
:mod:`learners.checkpoint`'s. Here: one save per step at most, the critic
beside the policy, rank 0's bookkeeping (:class:`~learners.checkpoint.LearnerState`)
built from the coordinator and the batcher and given back to them, and the
run's logs cut back to the checkpoint's step, since the steps after it were
undone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from asyncrl.observe.metrics import MetricsWriter, read_jsonl, read_metrics
from learners import checkpoint
from learners.batcher import GroupBatcher, RecentIds


class Checkpoints:
    """One rank's checkpoints of the policy (and critic): saved collectively, at most once per step."""

    def __init__(self, engine, folder: Path, rank: int, keep: int, critic=None) -> None:
        self.engine, self.folder, self.rank, self.keep, self.critic = engine, folder, rank, keep, critic
        self.saved_step: int | None = None  # the step of the newest checkpoint saved or resumed from

    def save(self, step: int, state: checkpoint.LearnerState | None) -> bool:
        """A checkpoint of ``step``, unless one was saved (or resumed from) at this step already; returns whether
        it saved. A stop right after a periodic checkpoint keeps that one, as a crash there would: what arrived
        since, drops and groups held, comes again from a durable buffer or is generated again."""
        if step == self.saved_step:
            return False
        checkpoint.save(self.engine, self.folder, step, state, self.rank, self.keep, critic=self.critic)
        self.saved_step = step
        return True

    def due(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` would write a checkpoint."""
        return step != self.saved_step

    def load(self) -> checkpoint.LearnerState:
        """Restore the engine, the critic and this rank's RNG from the newest checkpoint."""
        state = checkpoint.load(self.engine, self.folder, self.rank)
        if self.critic is not None:
            folder = self.folder / checkpoint.tag_of(state.step)
            path, _ = self.critic.load_checkpoint(str(folder), tag="critic")
            if path is None:
                raise RuntimeError(f"--resume: no critic state in {folder}")
        self.saved_step = state.step
        return state


def loop_state(
    step: int, version: int, coordinator, batcher: GroupBatcher, evals: list[tuple[int, int]] = ()
) -> checkpoint.LearnerState:
    """Rank 0's bookkeeping at ``step``: the tickets out (the groups the batcher holds among them), the
    staleness counters, the ids of the rollouts trained on and the evaluations not finished (``evals``)."""
    with coordinator.lock:  # no ticket admitted or taken back between the two reads
        tickets, bound = coordinator.state(), coordinator.bound.state()
    out = {t.group_id for t in tickets.outstanding}  # a group still arriving is out already: saved once
    tickets.outstanding += [t for t in batcher.held_tickets() if t.group_id not in out]
    return checkpoint.LearnerState(
        step=step,
        version=version,
        coordinator=tickets,
        bound=bound,
        consumed_ids=list(batcher.consumed_ids),  # oldest first
        by_length={bucket: dict(verdicts) for bucket, verdicts in batcher.by_length.items()},
        evals=list(evals),
    )


def restore_loop(state: checkpoint.LearnerState, coordinator, batcher: GroupBatcher, reissue: bool) -> None:
    """Give rank 0's bookkeeping back to the coordinator and the batcher; ``reissue`` the tickets that were out
    unless a durable buffer will deliver their rollouts again."""
    coordinator.bound.restore(state.bound)  # first: restoring the coordinator may release tickets
    coordinator.restore(state.coordinator, reissue=reissue)
    batcher.consumed_ids = RecentIds(state.consumed_ids)
    batcher.by_length.update((bucket, Counter(verdicts)) for bucket, verdicts in state.by_length.items())


@dataclass
class History:
    """What the run's logs say of the steps up to the checkpoint."""

    trained_s: float  # the run's training time up to the checkpoint (the metrics' wall_s)
    busy_s: float  # of which stepping and publishing
    last_reward: float | None  # the latest step's mean scored reward
    eval_results: list[dict]  # eval.jsonl's records


def groups_redone(state: checkpoint.LearnerState) -> set[str]:
    """The groups whose tickets a resumed learner hands out again under the same ids: out, or queued to go
    out again, at the checkpoint."""
    tickets = state.coordinator
    return {t.group_id for t in tickets.outstanding} | {group for _, group in tickets.requeued if group}


def rewind_logs(
    run_dir: Path, step: int, durable: bool, batcher: GroupBatcher, metrics: MetricsWriter, redone: set[str]
) -> History:
    """Cut the run's logs back to ``step`` and count the drops they keep; returns their :class:`History`.

    Steps after the checkpoint were undone: so are their records, their evaluations and TensorBoard's
    points. Clocks go on from the checkpoint's step (the time the learner was down is not counted).
    """
    # The run's drops are dropped.jsonl's records, up to a line torn by a crash mid-write. With ZeroMQ a drop is
    # final, unless its group is among the ``redone`` (:func:`groups_redone`): the group is sampled and
    # accounted again under the same rollout ids. With Redis (``durable``) drops after the checkpoint were
    # never acknowledged, and come again.
    checkpoint.truncate_log(
        run_dir / "dropped.jsonl",
        step,
        ordered=durable,
        keep_later=None if durable else lambda record: record["id"].rsplit("-", 1)[0] not in redone,
    )
    batcher.drops.update(r["reason"] for r in read_jsonl(run_dir / "dropped.jsonl"))
    for name in ("metrics.jsonl", "consumed.jsonl", "rollouts.jsonl"):
        checkpoint.truncate_log(run_dir / name, step)
    checkpoint.truncate_log(run_dir / "eval.jsonl", step, ordered=False)
    metrics.resume_at(step)
    records = read_metrics(run_dir)
    return History(
        trained_s=records[-1]["wall_s"] if records else 0.0,
        busy_s=sum(r["step_s"] + r.get("publish_s", 0.0) for r in records),
        # A run that scored rewards before is past its start: a reward server slow to come back after the
        # restart is an outage (task.unscored_steps_to_fail guards the start only).
        last_reward=next((r["reward"] for r in reversed(records) if r.get("reward") is not None), None),
        eval_results=read_jsonl(run_dir / "eval.jsonl"),
    )
