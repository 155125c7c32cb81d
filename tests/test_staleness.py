import threading

import pytest

from asyncrl.control.staleness import StalenessBound


def test_sync_admits_one_version_at_a_time():
    bound = StalenessBound(max_staleness=0, samples_per_version=16)
    assert bound.admit(weight_version=0, groups=10, group_size=4) == 4
    assert bound.admit(weight_version=0, groups=1, group_size=4) == 0  # wait for v1
    assert bound.admit(weight_version=1, groups=10, group_size=4) == 4


def test_async_admits_max_staleness_versions_ahead():
    bound = StalenessBound(max_staleness=2, samples_per_version=8)
    assert bound.admit(0, groups=100, group_size=2) == 12  # (0 + 2 + 1) * 8 / 2


def test_a_negative_request_admits_nothing_and_frees_nothing():
    bound = StalenessBound(max_staleness=0, samples_per_version=8)
    assert bound.admit(0, groups=-1000, group_size=2) == 0
    assert bound.admit(0, groups=100, group_size=2) == 4


def test_release_frees_slots():
    bound = StalenessBound(max_staleness=0, samples_per_version=4)
    assert bound.admit(0, 1, 4) == 1
    bound.release(4, "generator_lost")
    assert bound.admit(0, 1, 4) == 1
    assert bound.dropped["generator_lost"] == 4


def test_accept_enforces_the_bound_and_counts_drops():
    bound = StalenessBound(max_staleness=1, samples_per_version=4)
    assert bound.accept(oldest_version=4, learner_version=5)
    assert not bound.accept(oldest_version=3, learner_version=5)
    assert bound.consumed == 1 and bound.dropped["stale"] == 1


def test_on_exceed_correct_keeps_stale_samples_and_counts_them():
    bound = StalenessBound(max_staleness=1, samples_per_version=4, on_exceed="correct")
    assert bound.accept(oldest_version=3, learner_version=5)  # two versions past the bound: kept
    assert bound.accept(oldest_version=4, learner_version=5)
    assert not bound.accept(oldest_version=6, learner_version=5)  # a discarded future is never kept
    assert (bound.consumed, bound.corrected, dict(bound.dropped)) == (2, 1, {"future_version": 1})
    assert StalenessBound(1, 4).keeps("stale") is False and bound.keeps("stale") is True


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_staleness=-1, samples_per_version=1),
        dict(max_staleness=1, samples_per_version=1, on_exceed="weight"),
        dict(max_staleness=0, samples_per_version=0),
    ],
)
def test_invalid_bounds(bad):
    with pytest.raises(ValueError):
        StalenessBound(**bad)


def test_concurrent_producers_together_get_exactly_what_fits():
    """Generators' requests are answered on several threads at once: between them they are admitted
    exactly one version's worth, never a group more."""
    spv, group, producers = 64, 2, 8
    bound = StalenessBound(max_staleness=0, samples_per_version=spv)
    start = threading.Barrier(producers)
    granted = [0] * producers

    def producer(i):
        start.wait()
        for _ in range(100):
            granted[i] += bound.admit(0, groups=1, group_size=group)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) * group == bound.admitted == spv


def test_reordered_delivery_is_caught_at_consumption():
    """Generators finish out of order; the consumption check still drops what is over the bound."""
    bound = StalenessBound(max_staleness=1, samples_per_version=4)
    slow = bound.admit(0, groups=1, group_size=4)  # a slow generator's group at v0
    assert slow == 1
    for version in range(1, 4):  # faster generators keep the learner busy meanwhile
        assert bound.admit(version - 1, groups=1, group_size=4) == 1
        assert all(bound.accept(version - 1, version) for _ in range(4))
    assert [bound.accept(0, 3) for _ in range(4)] == [False] * 4
    assert bound.dropped["stale"] == 4


def test_samples_from_a_discarded_future_are_dropped():
    bound = StalenessBound(max_staleness=4, samples_per_version=4)
    assert not bound.accept(oldest_version=6, learner_version=5)
    assert bound.dropped["future_version"] == 1


def test_state_round_trips():
    bound = StalenessBound(max_staleness=1, samples_per_version=4)
    bound.admit(0, 2, 2)
    bound.accept(0, 0)
    bound.accept(0, 3)
    restored = StalenessBound(max_staleness=1, samples_per_version=4)
    restored.restore(bound.state())
    assert restored.state() == bound.state() and restored.admitted == 3
