"""Learner checkpoints on one CPU rank: which checkpoints a save keeps, and logs cut back on resume."""

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from learners import checkpoint


class DiskEngine:
    """Writes what DeepSpeed's ``save_checkpoint`` writes for a tag: a folder of state files."""

    def save_checkpoint(self, directory: str, tag: str, save_latest: bool) -> None:
        (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
        (Path(directory) / tag / "mp_rank_00_model_states.pt").write_bytes(b"state")


@pytest.fixture(scope="module", autouse=True)
def group_of_one(tmp_path_factory):
    """A save waits for every rank of the learner group: here, one."""
    if dist.is_initialized():  # by an engine test earlier in this process
        yield
        return
    store = tmp_path_factory.mktemp("group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[4:]) for p in directory.glob("step*"))


def test_a_save_keeps_the_newest_checkpoints_up_to_its_step(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save(DiskEngine(), tmp_path, step, None, 0, keep=2)
    assert _steps(tmp_path) == [20, 30] and checkpoint.latest(tmp_path) == checkpoint.tag_of(30)


@pytest.mark.parametrize("keep", [1, 2])
def test_checkpoints_past_the_saved_step_are_a_discarded_future_and_never_crowd_it_out(tmp_path, keep):
    # An earlier run in the same folder reached step 500; this run resumed from step 100 (and a save of
    # step 200 crashed before LATEST moved): its next checkpoint, of step 150, is the one to keep.
    for step in (50, 100, 200, 400, 500):
        DiskEngine().save_checkpoint(str(tmp_path), checkpoint.tag_of(step), False)
    (tmp_path / checkpoint.LATEST).write_text(checkpoint.tag_of(100))
    folder = checkpoint.save(DiskEngine(), tmp_path, 150, None, 0, keep=keep)
    assert checkpoint.latest(tmp_path) == folder.name == checkpoint.tag_of(150) and folder.is_dir()
    assert _steps(tmp_path) == [100, 150][-keep:]


def test_the_checkpoint_in_charge_is_never_written_over(tmp_path):
    checkpoint.save(DiskEngine(), tmp_path, 2, None, 0, keep=2)
    state_file = tmp_path / checkpoint.tag_of(2) / "mp_rank_00_model_states.pt"

    class TornEngine:  # killed mid-write
        def save_checkpoint(self, directory: str, tag: str, save_latest: bool) -> None:
            (Path(directory) / tag / "mp_rank_00_model_states.pt").write_bytes(b"TORN")
            raise RuntimeError("killed mid-write")

    with pytest.raises(ValueError, match="is the checkpoint in charge"):
        checkpoint.save(TornEngine(), tmp_path, 2, None, 0, keep=2)
    assert state_file.read_bytes() == b"state" and checkpoint.latest(tmp_path) == checkpoint.tag_of(2)


def test_a_folder_of_the_same_step_from_a_discarded_timeline_is_emptied_before_the_save(tmp_path):
    # A run with 4 ranks reached step 150 and crashed before LATEST moved; this one has 1 rank.
    leftover = tmp_path / checkpoint.tag_of(150)
    DiskEngine().save_checkpoint(str(tmp_path), leftover.name, False)
    (leftover / "rng_rank3.safetensors").write_bytes(b"another run's")
    (leftover / "critic").mkdir()
    (tmp_path / checkpoint.LATEST).write_text(checkpoint.tag_of(100))

    class Critic:
        def save_checkpoint(self, directory: str, tag: str, save_latest: bool) -> None:
            (Path(directory) / tag).mkdir(parents=True)
            (Path(directory) / tag / "critic_states.pt").write_bytes(b"critic")

    folder = checkpoint.save(DiskEngine(), tmp_path, 150, None, 0, keep=2, critic=Critic())
    assert sorted(p.name for p in folder.iterdir()) == [
        "asyncrl_state.json",
        "critic",
        "mp_rank_00_model_states.pt",
        "rng_rank0.safetensors",
    ]
    assert [p.name for p in (folder / "critic").iterdir()] == ["critic_states.pt"]


def test_a_stop_right_after_a_checkpoint_saves_nothing_again(tmp_path):
    """SIGTERM while the learner waits for the batch after a periodic checkpoint (or right after --resume)."""
    from learners.resume import Checkpoints

    checkpoints = Checkpoints(DiskEngine(), tmp_path, rank=0, keep=2)
    assert checkpoints.save(2, None)
    assert checkpoint.latest(tmp_path) == checkpoint.tag_of(2)
    checkpoints.engine = None  # a second save at this step would write with it, and fail
    assert not checkpoints.save(2, None)
    checkpoints.saved_step = 7  # resumed from step 7's checkpoint
    assert not checkpoints.save(7, None)
    assert checkpoint.latest(tmp_path) == checkpoint.tag_of(2)


def _log(path: Path, steps: list[int], tail: str = "") -> Path:
    path.write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in steps) + tail)
    return path


def test_a_log_is_cut_after_the_checkpoints_step(tmp_path):
    path = _log(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5])
    checkpoint.truncate_log(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("torn", ['{"step": 4, "rew', '{"step": 3, "reward": 0.5}'])
def test_a_record_cut_off_mid_write_ends_the_log(tmp_path, caplog, torn):
    """Killed while appending (the second case lost only its newline: the next record would be glued to it)."""
    path = _log(tmp_path / "metrics.jsonl", [1, 2, 3], torn)
    checkpoint.truncate_log(path, 3)
    assert path.read_text() == _log(tmp_path / "whole.jsonl", [1, 2, 3]).read_text()
    assert f"{path}: line 4 is not a whole record" in caplog.text


def test_a_log_that_is_not_of_learner_steps_is_refused_by_name(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"step": 1}\n{"version": 2}\n')
    with pytest.raises(ValueError, match=f"{path}, line 2: not a record of a learner step"):
        checkpoint.truncate_log(path, 3)


def test_evaluations_that_finished_out_of_order_keep_every_step_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"step": s, "pass@1": 0.1}) + "\n" for s in (0, 20, 10, 30)))
    checkpoint.truncate_log(path, 15, ordered=False)  # step 20's evaluation finished before step 10's
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 10]


def test_a_resumed_learner_undoes_the_later_drops_of_groups_it_hands_out_again(tmp_path):
    """ZeroMQ loses what was in flight: a drop after the checkpoint is final, unless the resumed learner hands
    the group out again under the same ids (its ticket was out at the checkpoint); then its rollouts are sampled
    and accounted anew, and a rollout must not stand as both dropped and trained on."""
    from asyncrl.control.tickets import CoordinatorState, OutstandingTicket
    from learners.resume import groups_redone

    path = tmp_path / "dropped.jsonl"
    drops = [(2, "a-g1-0"), (5, "a-g3-0"), (6, "b-g9-1"), (7, "a-g4-2")]
    path.write_text("".join(json.dumps({"step": s, "id": i, "reason": "stale"}) + "\n" for s, i in drops))
    tickets = CoordinatorState(
        session="a",
        next_group=10,
        epoch=0,
        position=4,
        outstanding=[OutstandingTicket(prompt_index=3, group_id="a-g3", generator_id="h2")],
        requeued=[(4, "a-g4"), (6, None)],
    )
    redone = groups_redone(checkpoint.LearnerState(step=4, version=4, coordinator=tickets, bound={}, consumed_ids=[]))
    assert redone == {"a-g3", "a-g4"}
    checkpoint.truncate_log(path, 4, ordered=False, keep_later=lambda r: r["id"].rsplit("-", 1)[0] not in redone)
    kept = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert kept == ["a-g1-0", "b-g9-1"]  # before the checkpoint, and a group that is not handed out again


def test_export_of_a_checkpoint_that_is_not_there_lists_those_that_are_and_the_published_versions(tmp_path):
    from learners.checkpoint import export_hf

    (tmp_path / "checkpoints" / "step00000002").mkdir(parents=True)
    (tmp_path / "weights" / "v000003").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError,
        match=r"--export: no checkpoint 'step00000009' under .*checkpoints \(there "
        r"are: step00000002\); the published versions are HF folders "
        r"already: .*weights/v000003",
    ):
        export_hf(tmp_path / "checkpoints", "step00000009", "unused", tmp_path / "out", "float32")


def test_a_group_half_arrived_at_a_checkpoint_is_saved_as_one_ticket_out_not_two():
    """Its ticket is out at the coordinator and its rollouts held by the batcher: issued twice after a resume,
    the same group ids would be generated twice and mixed."""
    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.staleness import StalenessBound
    from asyncrl.control.tickets import OutstandingTicket
    from asyncrl.wire.protocol import WorkRequest
    from learners.resume import loop_state

    coordinator = Coordinator(StalenessBound(1, 8), PromptCursor(10, seed=0), 2, 60.0, "s")
    [half, whole] = coordinator.handle_work(WorkRequest(generator_id="g", weight_version=0, max_groups=2)).tickets
    assert coordinator.complete(whole.group_id)  # arrived whole: no longer out, held by the batcher

    class Batcher:
        consumed_ids, by_length = [], {}

        def held_tickets(self):  # the half-arrived group and the whole one, as the batcher holds both
            return [OutstandingTicket(t.prompt_index, t.group_id, "g") for t in (half, whole)]

    saved = loop_state(3, 3, coordinator, Batcher()).coordinator.outstanding
    assert sorted(t.group_id for t in saved) == sorted([half.group_id, whole.group_id])


def test_a_checkpoint_reads_the_tickets_and_the_staleness_counters_of_one_moment():
    """The server thread admits and takes back tickets under the coordinator's lock: held across both reads, a
    ticket granted between them (admitted, yet not out) cannot leak its slots after a resume."""
    import threading

    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.staleness import StalenessBound
    from learners.resume import loop_state

    coordinator = Coordinator(StalenessBound(1, 8), PromptCursor(10, seed=0), 2, 60.0, "s")
    read = coordinator.bound.state
    server_could_work = []

    def counters():  # what the server thread finds meanwhile
        probe = threading.Thread(target=lambda: server_could_work.append(coordinator.lock.acquire(blocking=False)))
        probe.start()
        probe.join()
        return read()

    coordinator.bound.state = counters

    class Batcher:
        consumed_ids, by_length = [], {}

        def held_tickets(self):
            return []

    loop_state(1, 1, coordinator, Batcher())
    assert server_could_work == [False]
