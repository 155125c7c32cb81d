"""A generator hears of new weights through a request the learner holds, looked at without waiting.

Real ZeroMQ between a :class:`CoordinatorServer` and a :class:`VersionWatch`. The server holds requests on its
coordinator's fake clock, which stands still unless a test moves it; the watch gives up on a request by the
generator's own fake clock. Only the server thread's work is waited for, in real time (:func:`wait_for`).
"""

from conftest import FakeClock, wait_for

from asyncrl.control.client import CoordinatorClient
from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.server import CoordinatorServer
from asyncrl.control.staleness import StalenessBound
from asyncrl.wire.protocol import WeightUpdate, WorkRequest


def coordinator(clock: FakeClock) -> Coordinator:
    return Coordinator(StalenessBound(1, 8), PromptCursor(10, seed=0), 2, 60.0, "s", clock=clock)


def watch_request(c: Coordinator, held: list[int]):
    """Requests as a generator on the versions in ``held`` (its last entry) sends them."""
    return lambda: WorkRequest(
        generator_id="g", weight_version=held[-1], weight_session=c.session, max_groups=0, wait_s=1.0
    )


def test_a_published_version_is_heard_at_the_next_look_and_nothing_is_waited_for_before(tcp_address):
    c = coordinator(FakeClock())
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
    client = CoordinatorClient(tcp_address, timeout_s=5.0)
    held = [0]
    watch = client.watch(watch_request(c, held), hold_s=1.0, clock=FakeClock())
    try:
        assert watch.newest() is None  # sends the request
        wait_for(lambda: len(server._held) == 1)  # held: the learner has nothing newer yet
        assert [watch.newest() for _ in range(100)] == [None] * 100  # looks never wait for the answer
        c.publish(WeightUpdate(version=1, uri="file:///v1"))
        replies = []
        wait_for(lambda: (reply := watch.newest()) is not None and replies.append(reply) is None)
        assert replies[0].latest.version == 1 and replies[0].tickets == []
        held.append(1)  # the generator loads v1; the next look asks for what follows it
        assert watch.newest() is None
        wait_for(lambda: len(server._held) == 1)
        c.publish(WeightUpdate(version=2, uri="file:///v2"))
        wait_for(lambda: (reply := watch.newest()) is not None and replies.append(reply) is None)
        assert replies[1].latest.version == 2 and watch.answers == 2 and watch.lost == 0
    finally:
        client.close()
        server.close()


def test_an_unanswered_request_or_a_dropped_connection_is_given_up_and_asked_afresh(tcp_address):
    c, clock = coordinator(FakeClock()), FakeClock()
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
    client = CoordinatorClient(tcp_address, timeout_s=2.0)
    held = [0]
    watch = client.watch(watch_request(c, held), hold_s=1.0, clock=clock)
    try:
        # Held on the learner's clock, which stands still: it never answers, and the watch gives up after the
        # hold and the client's timeout (1 + 2 s) by its own.
        watch.newest()
        wait_for(lambda: len(server._held) == 1)
        clock.advance(2.9)
        assert watch.newest() is None and watch.lost == 0
        clock.advance(0.2)
        assert watch.newest() is None and watch.lost == 1
        # A learner that goes away under a held request: given up as soon as the connection is seen to drop.
        watch.newest()
        wait_for(lambda: len(server._held) == 2)  # beside the request given up, which the server holds still
        server.close()
        wait_for(lambda: watch._endpoint.disconnects() == 1)  # the drop reaches the socket's monitor
        clock.advance(0.6)  # the watch looks at its connection every half second at most
        assert watch.newest() is None and watch.lost == 2
        server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)  # the learner is back
        c.publish(WeightUpdate(version=1, uri="file:///v1"))
        replies = []
        wait_for(lambda: (reply := watch.newest()) is not None and replies.append(reply) is None)
        assert replies[0].latest.version == 1
    finally:
        client.close()
        server.close()


def test_a_held_watch_costs_the_learner_nothing_until_a_version_or_its_deadline(tcp_address):
    """The server asks a held work request again every recheck; a watch (no tickets wanted) only on a wake (a new
    version, a stop) or at its deadline, so that a learner with many generators watching is not kept busy."""
    import sys

    from asyncrl.control.server import SWITCH_INTERVAL_S

    clock = FakeClock()
    c = coordinator(clock)
    asked = []
    handle = c.handle_work
    c.handle_work = lambda request, final=True: asked.append(request.max_groups) or handle(request, final)
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
    client = CoordinatorClient(tcp_address, timeout_s=5.0)
    held = [0]
    watch = client.watch(watch_request(c, held), hold_s=1.0, clock=FakeClock())
    try:
        # Serving the coordinator shortens the interpreter's switch interval: a request waits less for the
        # learner's thread to let go of it.
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
        watch.newest()
        wait_for(lambda: len(server._held) == 1)
        wait_for(lambda: len(asked) >= 1)
        # Real time passes (the server's loop turns several times) and nothing changes: no second look.
        deadline_turns = server._turns + 3
        wait_for(lambda: server._turns >= deadline_turns)
        assert asked == [0] and len(server._held) == 1
        clock.advance(1.0)  # its deadline: answered, with nothing new
        replies = []
        wait_for(lambda: (reply := watch.newest()) is not None and replies.append(reply) is None)
        assert asked == [0, 0] and replies[0].latest is None
    finally:
        client.close()
        server.close()


def link_to(c: Coordinator, client: CoordinatorClient, clock: FakeClock, held: list[int]):
    """A generator's link to the learner, holding the versions in ``held`` (its last entry)."""
    from asyncrl.config import load_config
    from generators.learner_link import LearnerLink, Progress

    config = load_config(None, ["generator.learner_patience_s=30", "coordinator.long_poll_s=1.0"])
    return LearnerLink(
        config, "g", client, lambda: Progress(weight_version=held[-1], weight_session=c.session), clock=clock
    )


def test_a_stop_answered_to_the_watch_ends_the_batch_without_another_request(tcp_address):
    """The learner counts a generator told to stop once its watch is answered, and may close at once: the
    generator must act on that answer, not ask again (which would wait out its patience and fail)."""
    c, clock = coordinator(FakeClock()), FakeClock()
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
    client = CoordinatorClient(tcp_address, timeout_s=1.0)
    link, taken = link_to(c, client, clock, [0]), []
    try:
        c.publish(WeightUpdate(version=0, uri="file:///v0"))
        link.poll(taken.append)  # sends the watch
        wait_for(lambda: len(server._held) == 1)
        c.stop()
        wait_for(lambda: not c.generators_not_stopped())  # answered: the learner counts the generator as told
        server.close()  # and shuts down
        wait_for(lambda: link._watch._endpoint.socket.poll(0) != 0)
        link.poll(taken.append)
        assert link.stop_reason == "" and taken == []
        link.poll(taken.append)  # told: nothing more is asked of a learner that is gone
        assert link._asks == 1
    finally:
        client.close()


def test_a_generator_behind_the_latest_version_is_not_made_to_ask_every_engine_step(tcp_address):
    """A version the generator cannot take yet (a load backing off, a missed push) keeps its watch answered at
    once; those answers name nothing new, so the link tries the version again without asking the learner, and
    watches again only after ``generator.update_poll_s``."""
    c, clock = coordinator(FakeClock()), FakeClock()
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
    client = CoordinatorClient(tcp_address, timeout_s=5.0)
    link, taken = link_to(c, client, clock, [0]), []
    asked = []
    handle = c.handle_work
    c.handle_work = lambda request, final=True: asked.append(request.max_groups) or handle(request, final)
    try:
        c.publish(WeightUpdate(version=1, uri="file:///v1"))
        for _ in range(40):  # 40 engine steps of 5 ms; taking v1 fails every time
            link.poll(taken.append)
            if link._watch._sent_at is not None:
                wait_for(lambda: link._watch._endpoint.socket.poll(0) != 0)  # answered at once: v1 is newer
            clock.advance(0.005)
        # one watch answered, one ask for the version; then one watch per 0.25 s (update_poll_s), each
        # answer tried again without an ask
        assert [version.version for version in taken[:2]] == [1, 1]
        assert len(asked) <= 4 and len(taken) <= 3
        c.publish(WeightUpdate(version=2, uri="file:///v2"))  # news: asked for, and taken, at once again
        clock.advance(0.25)
        for _ in range(3):
            link.poll(taken.append)
            if link._watch._sent_at is not None:
                wait_for(lambda: link._watch._endpoint.socket.poll(0) != 0)
        assert taken[-1].version == 2
    finally:
        client.close()
        server.close()


def test_a_drop_between_two_watches_does_not_give_up_the_next_one(tcp_address):
    """The learner restarted while no watch was in flight: the next watch, sent to the new learner, is held
    there, and the drop before it does not count against it."""
    c, clock = coordinator(FakeClock()), FakeClock()
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
    client = CoordinatorClient(tcp_address, timeout_s=5.0)
    held = [0]
    watch = client.watch(watch_request(c, held), hold_s=1.0, clock=clock)
    try:
        watch.newest()
        wait_for(lambda: len(server._held) == 1)
        c.publish(WeightUpdate(version=1, uri="file:///v1"))
        wait_for(lambda: watch.newest() is not None)
        held.append(1)
        server.close()  # the learner restarts between two watches
        wait_for(lambda: watch._endpoint.disconnects() == 1)
        server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=1.0)
        watch.newest()  # the next watch
        wait_for(lambda: len(server._held) == 1)
        clock.advance(0.6)  # past the half second between looks at the connection
        assert watch.newest() is None and watch.lost == 0
        c.publish(WeightUpdate(version=2, uri="file:///v2"))
        replies = []
        wait_for(lambda: (reply := watch.newest()) is not None and replies.append(reply) is None)
        assert replies[0].latest.version == 2 and watch.lost == 0
    finally:
        client.close()
        server.close()
