"""The human view of a status snapshot: drops and rejections by reason, and each generator's liveness."""

from asyncrl.cli import format_status
from asyncrl.protocol import GeneratorStatus, Status


def test_status_view_shows_drops_rejections_and_liveness():
    now = 1000.0
    gens = [GeneratorStatus(generator_id=name, weight_version=7, samples_generated=80, busy_s=2.0,
                            last_seen_s=now - age) for name, age in (("fresh", 1.0), ("slow", 30.0), ("gone", 70.0))]
    s = Status(step=5, total_steps=10, version=7, max_staleness=1, samples_consumed=40,
               samples_dropped={"stale": 3, "orphaned": 2}, samples_admitted=50, buffer={"waiting": 4.0},
               generators=gens, rejected={"non_finite_reward": 1}, generator_lease_s=60.0, started_s=now - 10,
               now_s=now)
    view = format_status(s)
    assert "dropped {'stale': 3, 'orphaned': 2}" in view
    assert "rejected entries: {'non_finite_reward': 1}" in view
    lines = {line.split()[0]: line.split()[1] for line in view.splitlines() if line.startswith("  ")}
    assert lines == {"fresh": "alive", "slow": "quiet", "gone": "lost"}
    assert "40.0/s busy" in view
