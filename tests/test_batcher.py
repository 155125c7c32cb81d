"""The group batcher: complete groups in, every other rollout dropped with its reason, tickets let go at once."""

import msgspec
import pytest
from conftest import make_rollout

from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.staleness import StalenessBound
from asyncrl.wire.protocol import ProtocolError, Rollout, RolloutLimits, WorkRequest, decode_rollout, encode
from buffers.base import Rejections
from learners.batcher import GroupBatcher


class ScriptedReader:
    """A reader that delivers prepared entries (encoded, so they pass the real checks) one read at a time."""

    def __init__(self, limits: RolloutLimits) -> None:
        self.reads: list[list[bytes]] = []
        self.rejections = Rejections()
        self.limits = limits
        self.busy_s = None

    def get(self, max_items: int, timeout_s: float) -> list[Rollout]:
        out = []
        for data in self.reads.pop(0) if self.reads else []:
            try:
                out.append(decode_rollout(data, self.limits))
            except ProtocolError as exc:
                self.rejections.add(exc, "test entry")
        return out

    def stats(self) -> dict[str, float]:  # a round trip to Redis: never once per read
        raise AssertionError("the batcher called stats()")


def setup(group_size=2, max_staleness=1):
    coordinator = Coordinator(StalenessBound(max_staleness, 4), PromptCursor(10, seed=0), group_size, 60.0, "s")
    reader = ScriptedReader(RolloutLimits(max_bytes=4096, vocab_size=100))
    return coordinator, reader, GroupBatcher(reader, coordinator, timeout_s=5)


def member(ticket, i, group_size=2, versions=None, **fields):
    r = make_rollout(i, group=ticket.group_id, group_size=group_size, versions=versions)
    r = msgspec.structs.replace(r, prompt_index=ticket.prompt_index, **fields)
    return encode(r)


def tickets(coordinator, n):
    return coordinator.handle_work(WorkRequest(generator_id="g", weight_version=0, max_groups=n)).tickets


def test_complete_groups_make_a_batch():
    coordinator, reader, batcher = setup()
    a, b = tickets(coordinator, 2)
    reader.reads = [[member(a, 0), member(b, 0)], [member(a, 1), member(b, 1)]]
    batch = batcher.next_batch(2, learner_version=0)
    assert sorted(r.rollout_id for r in batch) == [
        f"{a.group_id}-0",
        f"{a.group_id}-1",
        f"{b.group_id}-0",
        f"{b.group_id}-1",
    ]
    assert not batcher.drops and batcher.oldest_waiting_version is None


def test_a_rejected_member_gives_its_ticket_back_at_once_and_its_prompt_is_issued_again():
    coordinator, reader, batcher = setup()
    bad, good = tickets(coordinator, 2)
    reader.reads = [
        [member(bad, 0), member(bad, 1, logprobs=[-0.5, float("nan"), -0.5])],
        [member(good, 0), member(good, 1)],
    ]
    batch = batcher.next_batch(1, learner_version=0)
    assert {r.group_id for r in batch} == {good.group_id}
    assert batcher.drops == {"non_finite_logprobs": 1, "rejected_group": 1}
    assert sorted(batcher.dropped) == [
        (f"{bad.group_id}-0", "rejected_group"),
        (f"{bad.group_id}-1", "non_finite_logprobs"),
    ]
    assert not coordinator.is_outstanding(bad.group_id)
    assert coordinator.bound.dropped["rejected"] == 2  # both admission slots are free again
    again = tickets(coordinator, 1)
    assert [t.prompt_index for t in again] == [bad.prompt_index] and again[0].group_id != bad.group_id


def test_an_oversized_member_lets_its_group_go_too():
    coordinator, reader, batcher = setup()
    bad, good = tickets(coordinator, 2)
    reader.reads = [[member(bad, 0, prompt_ids=[1] * 5000)], [member(good, 0), member(good, 1)]]
    batcher.next_batch(1, learner_version=0)
    assert batcher.drops == {"oversize": 1} and not coordinator.is_outstanding(bad.group_id)


def test_a_generator_sampling_another_group_size_is_refused_and_its_prompt_issued_again(caplog):
    """The learner trains groups of 2; a generator configured for 1 sample per prompt would make each of its
    samples a complete group of one, with no baseline, and change the batch's size."""
    coordinator, reader, batcher = setup()
    odd, good = tickets(coordinator, 2)
    reader.reads = [[member(odd, 0, group_size=1)], [member(good, 0), member(good, 1)]]
    batch = batcher.next_batch(1, learner_version=0)
    assert {r.group_id for r in batch} == {good.group_id}
    assert batcher.drops == {"wrong_group_size": 1} and not coordinator.is_outstanding(odd.group_id)
    assert [t.prompt_index for t in tickets(coordinator, 1)] == [odd.prompt_index]
    assert "generator gen-0 sends groups of 1 samples, this learner trains on groups of 2" in caplog.text


def test_orphans_duplicates_and_stale_samples_are_counted_by_reason():
    coordinator, reader, batcher = setup(max_staleness=0)
    a, b = tickets(coordinator, 2)
    coordinator.abandon(a.group_id, "test")  # a's ticket is gone: what arrives for it is an orphan
    batcher.consumed_ids.add(f"{b.group_id}-0")  # trained on before, redelivered
    reader.reads = [[member(a, 0), member(a, 1), member(b, 0)]]
    with pytest.raises(TimeoutError):
        batcher.timeout_s = 0.01
        batcher.next_batch(1, learner_version=0)
    assert batcher.drops == {"orphaned": 2, "duplicate": 1}
    assert sorted(r for _, r in batcher.dropped) == ["duplicate", "orphaned", "orphaned"]


def test_left_over_counts_what_was_received_and_what_is_still_queued():
    coordinator, reader, batcher = setup()
    a, b = tickets(coordinator, 2)
    reader.reads = [[member(a, 0)], [member(b, 0), member(b, 1)]]
    batcher.timeout_s = 0.01
    with pytest.raises(TimeoutError):
        batcher.next_batch(2, learner_version=0)
    assert batcher.oldest_waiting_version == 0
    reader.reads = [[member(a, 1)]]
    assert batcher.left_over(settle_s=0.05) == 1 + 2 + 1


def test_dynamic_sampling_drops_uniform_groups_and_refills_the_batch():
    coordinator, reader, _ = setup()
    batcher = GroupBatcher(reader, coordinator, timeout_s=5, skip_uniform=True)
    a, b, c = tickets(coordinator, 3)
    admitted = coordinator.bound.admitted
    reader.reads = [
        [member(a, 0, reward=1.0), member(a, 1, reward=1.0)],  # all equal: nothing to learn
        # one scored reward beside a failed one: nothing to compare it with
        [member(c, 0, reward=1.0), member(c, 1, reward=0.0, reward_failed=True)],
        [member(b, 0, reward=0.0), member(b, 1, reward=1.0)],
    ]
    batch = batcher.next_batch(1, learner_version=0)
    assert {r.group_id for r in batch} == {b.group_id}, "the uniform groups were skipped, not trained on"
    assert batcher.drops == {"uniform_reward": 2, "reward_failed": 2}, "a failed reward is told apart"
    assert coordinator.bound.admitted == admitted - 4, "the dropped samples gave their admission slots back"
    assert coordinator.bound.dropped["uniform_reward"] == 2 and coordinator.bound.dropped["reward_failed"] == 2


def test_a_group_cut_by_staleness_is_judged_by_all_its_rewards_and_its_stale_members_are_kept_as_peers():
    """A stale member is not trained on, but its reward is a draw from the same prompt: dynamic sampling
    looks at the whole group, and the group statistics get it as a peer (``algo.step_advantages``)."""
    coordinator, reader, _ = setup()
    batcher = GroupBatcher(reader, coordinator, timeout_s=5, skip_uniform=True)
    a, b, c = tickets(coordinator, 3)
    reader.reads = [
        [member(a, 0, reward=1.0, versions=[0, 0]), member(a, 1, reward=1.0, versions=[2, 2])],
        [member(b, 0, reward=0.0, versions=[0, 0]), member(b, 1, reward=1.0, versions=[2, 2])],
        [member(c, 0, reward=0.0, versions=[2, 2]), member(c, 1, reward=1.0, versions=[2, 2])],
    ]
    batch = batcher.next_batch(2, learner_version=2)
    assert [r.rollout_id for r in batch] == [f"{b.group_id}-1", f"{c.group_id}-0", f"{c.group_id}-1"]
    assert [r.rollout_id for r in batcher.stale_peers] == [f"{b.group_id}-0"]
    assert batcher.drops == {"stale": 2, "uniform_reward": 1}, "a: 1 and 1, one of them stale; no reward failed"


def test_dynamic_sampling_stops_when_no_group_has_anything_to_learn():
    coordinator, reader, _ = setup()
    batcher = GroupBatcher(reader, coordinator, timeout_s=5, skip_uniform=True, max_skip_rounds=2)
    a, b, c = tickets(coordinator, 3)
    reader.reads = [
        [member(a, 0, reward=1.0), member(a, 1, reward=1.0)],
        [member(b, 0, reward=0.0, reward_failed=True), member(b, 1, reward=0.0, reward_failed=True)],
        [member(c, 0, reward=0.0), member(c, 1, reward=1.0)],
    ]
    with pytest.raises(
        RuntimeError,
        match=r"dropped 2 groups \(\{'uniform_reward': 1, 'reward_failed': 1\}\) while "
        r"filling one batch of 1.*algo.dynamic_sampling_max_rounds",
    ):
        batcher.next_batch(1, learner_version=0)


@pytest.mark.parametrize("on_exceed", ["drop", "correct"])
def test_stale_samples_by_response_length(on_exceed):
    coordinator = Coordinator(StalenessBound(1, 4, on_exceed), PromptCursor(10, seed=0), 2, 60.0, "s")
    reader = ScriptedReader(RolloutLimits(max_bytes=4096, vocab_size=100))
    batcher = GroupBatcher(reader, coordinator, timeout_s=5, length_edges=(2, 4))
    a, b = tickets(coordinator, 2)
    # Group a: short responses, fresh. Group b: a long response sampled at v0, consumed at v2 (stale).
    reader.reads = [
        [member(a, 0, versions=[2, 2]), member(a, 1, versions=[2, 2, 2])],
        [member(b, 0, versions=[0] * 6), member(b, 1, versions=[2] * 4)],
    ]
    batch = batcher.next_batch(2, learner_version=2)
    kept = {r.rollout_id for r in batch}
    assert (f"{b.group_id}-0" in kept) == (on_exceed == "correct")
    assert batcher.staleness_by_length() == {
        "1-2": {"fresh": 1, "stale_rate": 0.0},
        "3-4": {"fresh": 2, "stale_rate": 0.0},
        ">4": {"stale": 1, "stale_rate": 1.0},
    }
    assert coordinator.bound.corrected == (1 if on_exceed == "correct" else 0)
    assert batcher.drops == ({} if on_exceed == "correct" else {"stale": 1})


def test_the_ids_kept_for_the_duplicate_label_are_bounded():
    from learners.batcher import RecentIds

    recent = RecentIds((f"r{i}" for i in range(10)), limit=4)
    recent.add("r3")  # forgotten already (only r6..r9 were kept): it comes back as the newest
    recent.update(["r10", "r11"])
    assert list(recent) == ["r9", "r3", "r10", "r11"] and "r0" not in recent and "r3" in recent
    assert len(RecentIds(f"r{i}" for i in range(100_000))) == 1 << 16, "a service trains for days"


@pytest.mark.parametrize("durable", [True, False])
def test_a_durable_buffer_hears_of_a_steps_drops_with_its_rollouts_at_the_checkpoint(durable, tmp_path):
    import types

    from learners.batcher import RecentIds
    from learners.records import Records

    acked = []
    driver = types.SimpleNamespace(
        reader=types.SimpleNamespace(ack=acked.extend), coordinator=types.SimpleNamespace(bound=None)
    )
    batcher = types.SimpleNamespace(dropped=[("s-g1-1", "stale")], consumed_ids=RecentIds())
    records = Records(tmp_path, driver, batcher, durable=durable, unscored_steps_to_fail=0)
    records.consumed(3, [make_rollout(0, group="s-g1", group_size=2)], [0])
    if durable:  # a crash before the checkpoint brings the whole group back, its stale member included
        assert acked == [] and records.unacked == ["s-g1-0", "s-g1-1"]
        records.checkpointed()
    else:
        assert records.unacked == []
    assert acked == ["s-g1-0", "s-g1-1"] and records.unacked == []
    assert batcher.dropped == [] and '"reason": "stale"' in (tmp_path / "dropped.jsonl").read_text()


@pytest.mark.realtime  # 0.6 s: GroupBatcher times learner.batch_timeout_s on time.monotonic itself
def test_a_stream_of_unusable_rollouts_does_not_hold_the_timeout_off():
    """Its only generator samples groups of 3 for a learner of groups of 2: every prompt comes back refused and
    is issued to it again. The learner must still say so within learner.batch_timeout_s, and keep up its
    housekeeping (status, evaluations, weight re-pushes) meanwhile, not wait for ever."""
    import threading
    import time

    coordinator, reader, _ = setup()
    housekeeping = []
    batcher = GroupBatcher(reader, coordinator, timeout_s=0.6, on_wait=lambda: housekeeping.append(1) and False)

    def wrong_sized(max_items, timeout_s):
        time.sleep(0.02)  # a read takes a little while, as a real one does: the stream does not spin a core
        return [decode_rollout(member(ticket, 0, group_size=3), reader.limits) for ticket in tickets(coordinator, 1)]

    reader.get = wrong_sized
    outcome = []
    waiting = threading.Thread(target=lambda: outcome.append(_raised(batcher.next_batch, 1, 0)), daemon=True)
    waiting.start()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "still waiting for a batch"
    assert isinstance(outcome[0], TimeoutError) and "'wrong_group_size': " in str(outcome[0])
    assert batcher.drops["wrong_group_size"] > 10 and 1 <= len(housekeeping) <= 2


def _raised(call, *args):
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001  (the outcome under test)
        return exc
    return None


def test_the_reward_window_is_reached_only_by_a_whole_window_at_the_target():
    from learners.records import RewardWindow

    window = RewardWindow(0.9, steps=3)
    for reward in (1.0, 1.0, None):  # a step with no scored rollout adds nothing
        window.add(reward)
    assert not window.reached(), "two steps are not a window of three"
    for reward in (0.6, 1.0, 1.0):
        window.add(reward)
        assert not window.reached(), list(window.rewards)  # 0.6 is in every window of three up to here
    window.add(0.95)
    assert window.reached() and window.mean() == pytest.approx(0.9833, abs=1e-4)
    always = RewardWindow(None, steps=1)
    always.add(1.0)
    assert not always.reached(), "no target: never"


def test_token_staleness_counts_the_tokens_that_newer_weights_sampled():
    """A sample is as stale as its oldest token; with weights that land mid-answer its later tokens are newer,
    and the token mean says how much newer."""
    from learners.records import token_staleness

    mid_answer = make_rollout(0, versions=[3, 3, 4, 4], n_tokens=4)  # the learner is at 4
    old = make_rollout(1, versions=[3, 3], n_tokens=2)
    assert mid_answer.oldest_version == 3
    assert token_staleness(4, [mid_answer, old]) == pytest.approx(4 / 6)
    assert token_staleness(4, []) == 0.0
    # an episode's environment replies are not trained on: only the model's tokens count
    import msgspec

    episode = msgspec.structs.replace(make_rollout(2, versions=[2, 2, 2, 4], n_tokens=4), loss_mask=[0, 0, 0, 1])
    assert token_staleness(4, [episode]) == 0.0
    assert token_staleness(4, [episode, old]) == pytest.approx(2 / 3)
