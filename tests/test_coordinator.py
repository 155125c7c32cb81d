import re
import threading

import msgspec
import pytest
import zmq
from conftest import FakeClock, wait_for

from asyncrl.config import EvalConfig
from asyncrl.control.client import CoordinatorClient, RemoteError, wait_for_reply
from asyncrl.control.coordinator import Coordinator, PromptCursor
from asyncrl.control.evaluation import EvalBook
from asyncrl.control.server import CoordinatorServer
from asyncrl.control.staleness import StalenessBound
from asyncrl.wire.peers import HandshakeRefused
from asyncrl.wire.protocol import Status, StatusRequest, WeightUpdate, WorkReply, WorkRequest, encode
from asyncrl.wire.sockets import Endpoint


def make(max_staleness=1, spv=8, group=2, prompts=10, lease_s=60.0, clock=None):
    """A coordinator on a :class:`FakeClock` (its own unless ``clock`` is given): leases expire when a test says."""
    bound, cursor = StalenessBound(max_staleness, spv), PromptCursor(prompts, seed=0)
    return Coordinator(bound, cursor, group, lease_s, "s", clock=clock or FakeClock())


def ask(c, gen="a", version=0, groups=100, session=None):
    """A work request from a generator on ``version`` as this learner announced it (unless ``session`` says
    another learner process did)."""
    return c.handle_work(
        WorkRequest(
            generator_id=gen,
            weight_version=version,
            max_groups=groups,
            weight_session=c.session if session is None else session,
        )
    )


def test_a_pool_shares_prompts_without_duplicates():
    c = make(max_staleness=10, spv=20, group=2, prompts=20)
    seen = []
    for gen in "abcd":
        seen += [t.prompt_index for t in ask(c, gen, groups=5).tickets]
    assert sorted(seen) == list(range(20))  # one epoch, every prompt exactly once
    assert len({t.group_id for t in ask(c, "a", groups=3).tickets}) == 3


def test_cursor_reshuffles_each_epoch_and_restores_from_its_state():
    cursor = PromptCursor(5, seed=1)
    first = [cursor.next() for _ in range(5)]
    second = [cursor.next() for _ in range(5)]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    restored = PromptCursor(5, seed=1, epoch=cursor.epoch, position=cursor.position)
    assert [restored.next() for _ in range(5)] == [cursor.next() for _ in range(5)]


def test_admission_is_backpressure():
    c = make(max_staleness=0, spv=8, group=2)
    assert len(ask(c).tickets) == 4
    reply = ask(c)
    assert reply.tickets == [] and reply.retry_after_s > 0


def test_generator_behind_latest_weights_must_load_first():
    c = make()
    c.publish(WeightUpdate(version=1, uri="file:///w/v1"))
    reply = ask(c, version=0)
    assert reply.tickets == [] and reply.latest.version == 1
    assert ask(c, version=1).tickets


def test_a_version_loaded_from_the_learner_before_its_restart_is_loaded_again():
    # A resumed learner numbers its versions on from its checkpoint: its v1 need not be the v1 a generator
    # took from the learner before the restart (a later checkpoint of it, or weights the resume threw away).
    c = make()
    c.publish(WeightUpdate(version=1, uri="file:///w/v1", session="ignored: the coordinator stamps its own"))
    assert c.latest.session == c.session == "s"
    reply = ask(c, version=1, session="learner-before-restart")
    assert reply.tickets == [] and reply.latest.identity == ("s", 1)
    assert ask(c, version=1).tickets
    assert c.lagging() == [], "once on this learner's v1"
    ask(c, gen="b", version=1, session="learner-before-restart")
    assert c.lagging() == ["b"], "a push it missed is pushed again"


def test_a_prompt_a_generators_engine_refused_is_issued_no_more_and_survives_a_restart():
    c = make(max_staleness=10, spv=4, group=2, prompts=3)
    tickets = ask(c, "a", groups=3).tickets
    refused = tickets[1]
    reply = c.handle_work(
        WorkRequest(
            generator_id="a",
            weight_version=0,
            max_groups=30,
            refused={refused.group_id: "ValueError: prompt too long", "s-g99": "unknown"},
        )
    )
    assert c.retired == {refused.prompt_index} and c.bound.dropped["prompt_refused"] == 2
    assert not c.is_outstanding(refused.group_id)
    assert refused.prompt_index not in {t.prompt_index for t in reply.tickets} and len(reply.tickets) > 10
    restored = make(max_staleness=10, spv=4, group=2, prompts=3)
    restored.restore(c.state(), reissue=True)
    assert refused.prompt_index not in {t.prompt_index for t in ask(restored, "b", groups=20).tickets}
    # Another generator cannot retire a ticket it does not hold.
    other = tickets[0]  # still out, with "a"
    c.handle_work(WorkRequest(generator_id="b", weight_version=0, max_groups=0, refused={other.group_id: "x"}))
    assert c.is_outstanding(other.group_id)


def test_a_draining_generators_goodbye_settles_the_tickets_its_engine_refused():
    c = make(max_staleness=10, spv=4, group=2, prompts=3)
    first, second = ask(c, "leaver", groups=2).tickets
    c.handle_work(
        WorkRequest(
            generator_id="leaver", weight_version=0, max_groups=0, leaving=True, refused={first.group_id: "too long"}
        )
    )
    assert not c.is_outstanding(first.group_id) and c.retired == {first.prompt_index}
    assert c.is_outstanding(second.group_id), "what it wrote settles as it arrives"


def test_silent_generator_tickets_are_reissued():
    clock = FakeClock()
    c = make(max_staleness=0, spv=4, group=2, lease_s=30.0, clock=clock)
    lost = {t.prompt_index for t in ask(c, "dead").tickets}
    assert ask(c, "alive").tickets == []  # the dead one holds every slot
    clock.advance(29.0)
    assert ask(c, "alive").tickets == [], "within its lease the silent one keeps its tickets"
    clock.advance(2.0)  # 31 s since "dead" last asked; "alive" asked 2 s ago
    reissued = {t.prompt_index for t in ask(c, "alive").tickets}
    assert reissued == lost
    assert c.bound.dropped["generator_lost"] == 4
    assert "dead" not in c.generators


def test_complete_closes_tickets_once():
    c = make()
    ticket = ask(c, groups=1).tickets[0]
    assert c.complete(ticket.group_id)
    assert not c.complete(ticket.group_id)


def test_stop_is_heard_by_every_generator():
    c = make()
    ask(c, "a")
    c.stop()
    assert c.generators_not_stopped() == {"a"}
    assert ask(c, "a").stop
    assert c.generators_not_stopped() == set()


def test_server_and_client_over_zmq(tcp_address):
    c = make()
    status = Status(
        step=3,
        total_steps=10,
        version=2,
        max_staleness=1,
        samples_consumed=5,
        samples_dropped={},
        samples_admitted=9,
        buffer={},
        generators=[],
    )
    server = CoordinatorServer(c, tcp_address, lambda: status)
    client = CoordinatorClient(tcp_address, timeout_s=5)
    try:
        reply = client.call(WorkRequest(generator_id="g", weight_version=0, max_groups=2), WorkReply)
        assert len(reply.tickets) == 2
        assert client.call(StatusRequest(), Status) == status
        raw = Endpoint(zmq.DEALER, tcp_address, bind=False, field="test")
        raw.socket.send_multipart([b"", b"garbage"])  # rejected, counted, and the server keeps serving
        wait_for(lambda: server.rejected > 0, timeout_s=5)
        raw.close()
        assert server.rejected == 1
        assert client.call(StatusRequest(), Status).step == 3
    finally:
        client.close()
        server.close()


def test_a_generator_of_another_run_is_refused_and_given_no_work(tcp_address):
    """A generator of a run whose learner once listened on this address must not take this run's tickets."""
    c = make()
    server = CoordinatorServer(c, tcp_address, lambda: None, run_id="run-a")
    client = CoordinatorClient(tcp_address, timeout_s=5)
    try:
        with pytest.raises(RemoteError, match=r"coordinator.run_id: this learner serves run run-a, not run run-b"):
            client.call(WorkRequest(generator_id="g", weight_version=0, max_groups=2, run_id="run-b"), WorkReply)
        assert server.foreign == 1 and not c._outstanding  # no ticket went to it
        # its own run's generator, and one started by hand without an id, are served
        mine = client.call(WorkRequest(generator_id="g", weight_version=0, max_groups=1, run_id="run-a"), WorkReply)
        by_hand = client.call(WorkRequest(generator_id="h", weight_version=0, max_groups=1), WorkReply)
        assert len(mine.tickets) == len(by_hand.tickets) == 1
    finally:
        client.close()
        server.close()


def test_a_request_over_the_size_cap_is_never_read_and_the_server_keeps_serving(tcp_address):
    """A peer's 1.5 GB frame was read whole (1.9 GB held afterwards) before it was rejected as malformed."""
    from asyncrl.wire.sockets import RequestServer

    server = RequestServer(
        tcp_address, "test.address", StatusRequest, lambda request, final: request, max_request_bytes=4096
    )
    client = CoordinatorClient(tcp_address, timeout_s=5)
    raw = Endpoint(zmq.DEALER, tcp_address, bind=False, field="test")
    try:
        raw.socket.send_multipart([b"", encode(StatusRequest()) + b"\0" * 2**20])
        assert isinstance(client.call(StatusRequest(), StatusRequest), StatusRequest)
        # The same peer asks next. Its answer comes after whatever the server took in from that peer before:
        # on the same connection if the big frame got through, on a fresh one if ZeroMQ dropped the peer (a
        # request sent into the dropped connection is lost, so it asks again until answered).
        for _ in range(100):
            raw.socket.send_multipart([b"", encode(StatusRequest())])
            if raw.socket.poll(100):  # real time: the server's thread answering
                break
        assert raw.socket.poll(0), "the peer was never answered"
        assert server.rejected == 0, "ZeroMQ dropped the frame: nothing reached the decoder"
    finally:
        raw.close()
        client.close()
        server.close()


@pytest.mark.realtime  # the client's timeout is a ZeroMQ poll: 0.5 s of real time
def test_a_reply_that_cannot_be_sent_is_counted_and_the_server_keeps_serving(tcp_address):
    """Whatever fails past the handler (here: a reply msgspec cannot encode) must not end the server's thread."""
    from asyncrl.wire.sockets import RequestServer

    replies = iter([object(), StatusRequest()])
    server = RequestServer(tcp_address, "test.address", StatusRequest, lambda request, final: next(replies))
    broken, client = CoordinatorClient(tcp_address, timeout_s=0.5), CoordinatorClient(tcp_address, timeout_s=5)
    try:
        with pytest.raises(TimeoutError):
            broken.call(StatusRequest(), StatusRequest)
        wait_for(lambda: server.errors == 1, timeout_s=10)
        assert isinstance(client.call(StatusRequest(), StatusRequest), StatusRequest)
    finally:
        broken.close()
        client.close()
        server.close()


@pytest.mark.realtime  # the client's timeout is a ZeroMQ poll: 0.2 s of real time
def test_client_times_out_with_a_clear_error(tcp_address):
    client = CoordinatorClient(tcp_address, timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError, match=tcp_address):
            client.call(StatusRequest(), Status)
    finally:
        client.close()


def test_restore_reissues_lost_tickets_under_their_ids():
    old = make(max_staleness=0, spv=4, group=2)
    issued = ask(old, "a").tickets
    state = old.state()
    new = Coordinator(StalenessBound(0, 4), PromptCursor(10, seed=0), 2, 60.0, "new")
    new.bound.restore(old.bound.state())
    new.restore(state, reissue=True)
    again = ask(new, "b").tickets
    assert again == issued  # same prompts, same group ids: their rollout ids are stable
    fresh = ask(new, "b", version=1).tickets
    assert all(t.group_id.startswith("new-g") for t in fresh)
    assert [t.prompt_index for t in fresh] == [t.prompt_index for t in ask(old, "a", version=1).tickets]


def test_restore_for_a_durable_buffer_waits_for_tickets_out():
    old = make(max_staleness=0, spv=4, group=2, lease_s=30.0)
    issued = ask(old, "a").tickets
    clock = FakeClock()
    new = Coordinator(StalenessBound(0, 4), PromptCursor(10, seed=0), 2, 30.0, "new", clock=clock)
    new.bound.restore(old.bound.state())
    new.restore(old.state(), reissue=False)
    assert all(new.is_outstanding(t.group_id) for t in issued)
    assert new.complete(issued[0].group_id)
    clock.advance(29.0)
    assert ask(new, "b").tickets == [], "its owner has a fresh lease from the restore"
    clock.advance(2.0)  # "a" never comes back: its other ticket is reissued under a new id
    reissued = ask(new, "b").tickets
    assert [t.prompt_index for t in reissued] == [issued[1].prompt_index]
    assert reissued[0].group_id.startswith("new-")


def test_a_generator_restarted_while_the_learner_was_down_gets_its_tickets_issued_again_after_the_resume():
    """A durable buffer's resume keeps tickets out for their owners; a new process under an owner's id (the
    machine was lost with the learner) will never deliver them: taken back at once, as while the learner runs."""
    old = make(max_staleness=0, spv=4, group=2, lease_s=30.0)
    held = old.handle_work(WorkRequest(generator_id="a", weight_version=0, max_groups=2, incarnation="a1")).tickets
    state = msgspec.json.decode(msgspec.json.encode(old.state()), type=type(old.state()))  # as checkpointed
    new = Coordinator(StalenessBound(0, 4), PromptCursor(10, seed=0), 2, 30.0, "new", clock=FakeClock())
    new.bound.restore(old.bound.state())
    new.restore(state, reissue=False)
    same = new.handle_work(WorkRequest(generator_id="a", weight_version=0, max_groups=2, incarnation="a1"))
    assert same.tickets == [] and all(new.is_outstanding(t.group_id) for t in held)  # it still generates them
    again = new.handle_work(WorkRequest(generator_id="a", weight_version=0, max_groups=2, incarnation="a2"))
    assert not any(new.is_outstanding(t.group_id) for t in held)
    assert new.bound.dropped["generator_restarted"] == 4
    assert sorted(t.prompt_index for t in again.tickets) == sorted(t.prompt_index for t in held)


def test_a_failing_handler_answers_with_an_error_and_the_server_keeps_serving(tcp_address):
    calls = []

    def status():
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug in a handler")
        return Status(
            step=4,
            total_steps=10,
            version=2,
            max_staleness=1,
            samples_consumed=5,
            samples_dropped={},
            samples_admitted=9,
            buffer={},
            generators=[],
        )

    server = CoordinatorServer(make(), tcp_address, status)
    client = CoordinatorClient(tcp_address, timeout_s=5)
    try:
        # A RemoteError, not the TimeoutError of a reply that never came: the caller hears of the failure at once.
        with pytest.raises(RemoteError, match="KeyError: 'a bug in a handler'"):
            client.call(StatusRequest(), Status)
        assert server.errors == 1
        assert client.call(StatusRequest(), Status).step == 4  # the same thread still serves
        assert client.call(WorkRequest(generator_id="g", weight_version=0, max_groups=1), WorkReply).tickets
    finally:
        client.close()
        server.close()


@pytest.mark.realtime  # about 2 s: the client's timeouts are ZeroMQ polls, and the learner starts 0.5 s late
def test_wait_for_reply_outlasts_a_late_learner_and_gives_up_with_a_clear_error(tcp_address):
    client = CoordinatorClient(tcp_address, timeout_s=0.2)
    status = Status(
        step=1,
        total_steps=2,
        version=0,
        max_staleness=1,
        samples_consumed=0,
        samples_dropped={},
        samples_admitted=0,
        buffer={},
        generators=[],
    )
    try:
        with pytest.raises(TimeoutError, match=rf"{tcp_address} \(coordinator.address\) did not answer for 1s"):
            wait_for_reply(client, StatusRequest(), Status, patience_s=0.7)
        timer = threading.Timer(0.5, lambda: servers.append(CoordinatorServer(make(), tcp_address, lambda: status)))
        servers: list = []
        timer.start()  # the learner starts while the generator is already waiting
        assert wait_for_reply(client, StatusRequest(), Status, patience_s=10).step == 1
    finally:
        client.close()
        for server in servers:
            server.close()


def _held_call(address, request, results):
    """One call on a connection of its own; its reply is appended to ``results``."""
    client = CoordinatorClient(address, timeout_s=10)
    try:
        results.append(client.call(request, WorkReply))
    finally:
        client.close()


def _start_held_call(server, address, request):
    """A call in a thread, returned with its results once the server holds its request."""
    results = []
    waiter = threading.Thread(target=_held_call, args=(address, request, results), daemon=True)
    waiter.start()
    # Real time: the server's thread takes the request in on its own schedule. Nothing expires meanwhile: the
    # server holds requests on its coordinator's fake clock, which stands still until the test moves it.
    wait_for(lambda: len(server._held) == 1 or results, timeout_s=10)
    assert results == [], "answered with nothing instead of holding the request"
    return waiter, results


def test_a_request_with_no_work_yet_is_held_until_a_new_version_arrives(tcp_address):
    """A long poll: the generator hears of the new version when it is published, not after a sleep."""
    c = make(max_staleness=0, spv=4, group=2)  # version 0 admits 4 samples: two groups
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=5.0)
    try:
        assert len(ask(c, groups=2).tickets) == 2  # the version's whole allowance
        request = WorkRequest(generator_id="a", weight_version=0, max_groups=2, wait_s=5.0)
        waiter, results = _start_held_call(server, tcp_address, request)
        c.publish(WeightUpdate(version=1, uri="file:///v1"))  # the clock stands still: only this can answer it
        waiter.join(timeout=10)
        [reply] = results
        assert reply.latest.version == 1 and reply.retry_after_s == 0
    finally:
        server.close()


def test_a_held_request_is_answered_when_its_wait_is_up_and_the_hold_is_capped(tcp_address):
    clock = FakeClock()
    c = make(max_staleness=0, spv=4, group=2, clock=clock)
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=0.5)
    try:
        ask(c, groups=2)
        # Asks to be held 30 s; the server holds it at most 0.5 s, then answers: nothing yet, ask again.
        request = WorkRequest(generator_id="a", weight_version=0, max_groups=2, wait_s=30.0)
        waiter, results = _start_held_call(server, tcp_address, request)
        clock.advance(0.5)
        waiter.join(timeout=10)
        [reply] = results
        assert reply.tickets == [] and reply.retry_after_s == 0
    finally:
        server.close()


def test_a_request_that_cannot_wait_is_answered_at_once_and_freed_slots_answer_a_held_one(tcp_address):
    c = make(max_staleness=0, spv=4, group=2)
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=30.0)
    try:
        ask(c, groups=2)
        results = []
        # wait_s 0: answered at once (the clock stands still: a hold would never end), with a short sleep suggested.
        _held_call(tcp_address, WorkRequest(generator_id="a", weight_version=0, max_groups=2), results)
        [reply] = results
        assert reply.tickets == [] and reply.retry_after_s > 0
        # Held for up to 30 s: an abandoned ticket's freed slots answer it with that ticket's prompt.
        request = WorkRequest(generator_id="a", weight_version=0, max_groups=2, wait_s=30.0)
        waiter, results = _start_held_call(server, tcp_address, request)
        assert c.abandon(next(iter(c._outstanding)), "rejected")
        waiter.join(timeout=10)
        [reply] = results
        assert len(reply.tickets) == 1
    finally:
        server.close()


def test_a_generator_restarted_under_its_id_gets_its_old_tickets_issued_again_at_once():
    c = make(max_staleness=3, spv=8, group=2)

    def ask_as(incarnation, groups):
        return c.handle_work(
            WorkRequest(generator_id="g", weight_version=0, max_groups=groups, incarnation=incarnation)
        )

    held = ask_as("first", 2).tickets
    assert len(held) == 2 and all(c.is_outstanding(t.group_id) for t in held)
    assert ask_as("first", 0).tickets == []  # the same process again: nothing changes
    again = ask_as("second", 2).tickets  # a new process with the same id
    assert not any(c.is_outstanding(t.group_id) for t in held)
    assert c.bound.dropped["generator_restarted"] == 4
    assert [t.prompt_index for t in again] == [t.prompt_index for t in held]  # the same prompts, first
    assert {t.group_id for t in again}.isdisjoint(t.group_id for t in held)  # under new group ids


def test_an_earlier_process_still_asking_under_a_replaced_id_is_told_to_stop_and_takes_nothing_back():
    """Two live processes under one id must not re-issue each other's tickets at every request."""
    c = make(max_staleness=3, spv=8, group=2)

    def ask_as(incarnation, groups):
        return c.handle_work(
            WorkRequest(generator_id="g", weight_version=0, max_groups=groups, incarnation=incarnation)
        )

    ask_as("first", 2)
    held = ask_as("second", 2).tickets  # the later start takes over the id
    reply = ask_as("first", 2)  # the earlier process, still alive
    assert reply.stop and reply.tickets == [] and "another process now runs as generator g" in reply.reason
    assert all(c.is_outstanding(t.group_id) for t in held)  # the later process keeps its tickets
    assert c.bound.dropped["generator_restarted"] == 4  # once, at the takeover
    assert c.generators["g"].incarnation == "second"
    assert ask_as("second", 0).stop is False


def test_a_request_sent_again_after_its_reply_was_lost_gets_the_same_tickets():
    c = make(max_staleness=0, spv=4, group=2)
    request = WorkRequest(generator_id="a", weight_version=0, max_groups=2, weight_session=c.session, request_id="i-1")
    first = c.handle_work(request)
    assert len(first.tickets) == 2
    again = c.handle_work(request)  # its reply never reached the generator, which sends the same request
    assert again.tickets == first.tickets and c.bound.admitted == 4, "no second set of slots"
    fresh = c.handle_work(msgspec.structs.replace(request, request_id="i-2"))
    assert fresh.tickets == [], "a new request finds the slots taken by the tickets it holds"


def test_a_request_sent_again_after_some_of_its_tickets_were_taken_back_is_answered_anew():
    c = make(max_staleness=0, spv=4, group=2)
    request = WorkRequest(generator_id="a", weight_version=0, max_groups=2, weight_session=c.session, request_id="i-1")
    first = c.handle_work(request)
    assert c.abandon(first.tickets[0].group_id, "rejected")  # one ticket went back meanwhile
    again = c.handle_work(request)
    assert len(again.tickets) == 2 and not {t.group_id for t in again.tickets} & {t.group_id for t in first.tickets}
    assert c.bound.dropped["reply_lost"] == 2, "the ticket the generator never got was taken back too"
    assert {t.prompt_index for t in again.tickets} == {t.prompt_index for t in first.tickets}


@pytest.mark.realtime  # the client's timeout is a ZeroMQ poll: 0.2 s of real time
def test_a_reply_lost_to_a_client_timeout_is_sent_again_over_zmq(tcp_address):
    c = make(max_staleness=0, spv=4, group=2)
    answer, calls, client_gave_up = c.handle_work, [], threading.Event()

    def late_once(request, final=True):
        reply = answer(request, final)
        calls.append(request.request_id)
        if len(calls) == 1:
            assert client_gave_up.wait(10)  # the reply leaves after the client gave up on it
        return reply

    c.handle_work = late_once
    server = CoordinatorServer(c, tcp_address, lambda: None, max_hold_s=0.0)
    client = CoordinatorClient(tcp_address, timeout_s=0.2)
    try:
        request = WorkRequest(
            generator_id="a", weight_version=0, max_groups=2, weight_session=c.session, request_id="i-1"
        )
        with pytest.raises(TimeoutError):
            client.call(request, WorkReply)
        client_gave_up.set()
        reply = wait_for_reply(client, request, WorkReply, patience_s=10)  # sends the same request again
        assert len(calls) >= 2 and len(reply.tickets) == 2, "the retry brought the tickets of the lost reply"
        assert c.bound.admitted == 4 and all(c.is_outstanding(t.group_id) for t in reply.tickets)
    finally:
        client.close()
        server.close()


def test_requests_in_quick_succession_scan_for_overdue_tickets_once_a_second_at_most():
    clock = FakeClock()
    c = Coordinator(
        StalenessBound(1, 8), PromptCursor(100, seed=0), 2, lease_s=60.0, session="s", ticket_timeout_s=0.0, clock=clock
    )  # every ticket is overdue as soon as any time passes
    first = ask(c, "a", groups=2).tickets
    for _ in range(90):  # a held long poll is asked again every few milliseconds
        clock.advance(0.01)
        ask(c, "b", groups=0)
    assert all(c.is_outstanding(t.group_id) for t in first), "no scan of every ticket on each of them"
    clock.advance(0.2)  # over a second since the last scan
    ask(c, "b", groups=0)
    assert not any(c.is_outstanding(t.group_id) for t in first)
    assert c.bound.dropped["ticket_timeout"] == 4


def test_groups_a_lost_or_restarted_generator_wrote_to_a_durable_buffer_are_not_generated_again():
    """Its groups in the buffer arrive and complete; only the ones it never wrote go out again."""
    clock = FakeClock()
    c = make(max_staleness=3, spv=8, group=2, lease_s=30.0, clock=clock)

    def ask_as(gen, incarnation, groups, written=()):
        return c.handle_work(
            WorkRequest(
                generator_id=gen, weight_version=0, max_groups=groups, incarnation=incarnation, written=list(written)
            )
        )

    lost = ask_as("lost", "1", 3).tickets
    restarted = ask_as("restarted", "1", 3).tickets
    ask_as("lost", "1", 0, written=[lost[0].group_id, "s-g999"])  # an unknown id is ignored
    ask_as("restarted", "1", 0, written=[restarted[0].group_id, lost[1].group_id])  # not its ticket: ignored
    again = ask_as("restarted", "2", 0).tickets  # a new process: what the old one did not write goes out again
    assert c.bound.dropped["generator_restarted"] == 4
    clock.advance(31.0)
    again += ask_as("restarted", "2", 4).tickets  # "lost" has been silent past its lease: reissued first
    assert c.bound.dropped["generator_lost"] == 4
    assert sorted(t.prompt_index for t in again) == sorted(t.prompt_index for t in lost[1:] + restarted[1:])
    assert c.is_outstanding(lost[0].group_id) and c.is_outstanding(restarted[0].group_id)
    assert c.complete(lost[0].group_id) and c.complete(restarted[0].group_id)  # they arrive from the buffer


def test_a_written_group_is_still_taken_back_when_its_ticket_times_out_and_survives_a_restore():
    c = make(max_staleness=3, spv=8, group=2, lease_s=60.0)
    [ticket] = ask(c, "a", groups=1).tickets
    c.handle_work(WorkRequest(generator_id="a", weight_version=0, max_groups=0, written=[ticket.group_id]))
    state = c.state()
    assert state.written == [ticket.group_id]
    clock = FakeClock()
    resumed = Coordinator(StalenessBound(3, 8), PromptCursor(10, seed=0), 2, 30.0, "new", clock=clock)
    resumed.restore(msgspec.json.decode(msgspec.json.encode(state), type=type(state)), reissue=False)
    clock.advance(31.0)  # "a" never comes back, but its group is in the buffer
    [other] = ask(resumed, "b", groups=1).tickets
    assert other.prompt_index != ticket.prompt_index
    assert resumed.is_outstanding(ticket.group_id) and resumed.complete(other.group_id)
    clock.advance(600.0)  # past ticket_timeout_s (600 s by default) since the restore, and the group never came
    assert ask(resumed, "b", groups=1).tickets[0].prompt_index == ticket.prompt_index
    assert not resumed.is_outstanding(ticket.group_id)
    assert resumed.bound.dropped["ticket_timeout"] == 2


@pytest.mark.parametrize(
    ("server_key", "client_key", "says"),
    [
        (
            "a",
            "b",
            "its CURVE key may not be this run's (give both ends the run's key files: coordinator.curve_secret_file)",
        ),
        (None, None, "connected, and the peer did not answer in time"),
        ("none", None, "no connection: nothing accepts connections at that address"),
        ("proxy", None, "the peer closed the connection during it"),
    ],
    ids=["another-runs-key", "silent-peer", "nothing-listening", "proxy-before-its-service"],
)
def test_a_learner_that_does_not_answer_is_told_apart_and_waited_for(
    tmp_path, tcp_address, server_key, client_key, says
):
    """Each is waited out with patience (a learner starting, or a proxy in front of it whose service is not up
    yet, look the same for a while), and the final error says which it looked like."""
    from asyncrl.wire.sockets import create_certificate

    keys = {name: str(create_certificate(tmp_path / name)) for name in ("a", "b")}
    if server_key == "proxy":  # takes the connection and closes it, as a proxy does while its service is down
        server = _closing_listener(tcp_address)
    elif server_key != "none":  # takes requests and never answers them
        server = Endpoint(zmq.ROUTER, tcp_address, bind=True, field="test", curve_secret_file=keys.get(server_key))
    client = CoordinatorClient(tcp_address, timeout_s=0.5, curve_secret_file=keys.get(client_key))
    try:
        with pytest.raises(
            TimeoutError, match=re.escape(f"{tcp_address} (coordinator.address) did not answer for 1s")
        ) as error:
            wait_for_reply(client, StatusRequest(), Status, patience_s=1.2)
        assert says in str(error.value)
    finally:
        client.close()
        if server_key != "none":
            server.close()


def test_curve_on_one_end_only_is_refused_at_once_naming_the_key(tmp_path, tcp_address):
    """No wait mends it: the generator stops (HandshakeRefused), where silence is waited out."""
    from asyncrl.wire.sockets import create_certificate

    secret = str(create_certificate(tmp_path / "run"))
    server = Endpoint(zmq.ROUTER, tcp_address, bind=True, field="test", curve_secret_file=secret)
    client = CoordinatorClient(tcp_address, timeout_s=0.5)
    try:
        expected = "the peer has CURVE on and this end does not (set coordinator.curve_secret_file)"
        with pytest.raises(HandshakeRefused, match=re.escape(expected)):
            wait_for_reply(client, StatusRequest(), Status, patience_s=60)
    finally:
        client.close()
        server.close()


def _closing_listener(address: str):
    """A TCP listener on ``address`` that accepts each connection and closes it at once, until closed."""
    import socket as sockets
    from urllib.parse import urlparse

    parsed = urlparse(address)
    listener = sockets.create_server((parsed.hostname, parsed.port))
    listener.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                listener.accept()[0].close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    class Closing:
        def close(self) -> None:
            stop.set()
            thread.join(timeout=5)
            listener.close()

    return Closing()


def test_a_draining_generators_goodbye_counts_what_it_generated_since_its_last_request():
    c = make()
    c.evals = EvalBook(EvalConfig(every_steps=10, k=1, items_per_request=2, max_share=0.5), 4, 8, threshold=1.0)

    def request(samples: int, leaving: bool = False) -> WorkRequest:
        return WorkRequest(
            generator_id="d",
            weight_version=0,
            max_groups=0,
            samples_generated=samples,
            tokens_generated=10 * samples,
            incarnation="d-1",
            leaving=leaving,
        )

    c.evals.schedule(version=0, step=0, budgeted=False)
    assert c.evals.next_piece(0) is not None  # 2 prompts, a greedy answer and a sample each: 4 sequences
    c.handle_work(request(0))
    c.handle_work(request(12))
    assert c.handle_work(request(20, leaving=True)).stop
    assert c.samples_generated() == 20 and c.roster.since_heard == (20, 200)
    assert c.evals.share() == 4 / (4 + 20), "evaluation's share counts the goodbye's last 8 samples"


def test_samples_generated_in_all_keep_a_generator_forgotten_or_restarted():
    """What generated samples/s is measured from (metrics.jsonl's generated_samples), and the tokens evaluation's
    budget is earned from: a generator that goes silent and is forgotten, comes back, or restarts under its id
    neither takes its samples away nor counts them twice."""
    c = make(lease_s=10.0)

    def report(gen: str, samples: int, incarnation: str) -> None:
        request = WorkRequest(
            generator_id=gen,
            weight_version=0,
            max_groups=0,
            samples_generated=samples,
            tokens_generated=3 * samples,
            incarnation=incarnation,
        )
        c.handle_work(request)

    report("a", 10, "a-1")
    report("b", 4, "b-1")
    report("a", 25, "a-1")
    assert c.samples_generated() == 29
    c.clock.advance(11.0)
    report("c", 0, "c-1")  # a and b silent past their lease: forgotten when the next request comes
    assert [g.generator_id for g in c.generator_list()] == ["c"] and c.samples_generated() == 29
    report("a", 30, "a-1")  # back: only what it made since counts
    report("a", 5, "a-2")  # restarted under its id: a new process counting from 0
    assert c.samples_generated() == 29 + 5 + 5
    # evaluation's budget counts from each process's first request: a's 10 and b's 4 (made before this
    # coordinator heard of them, as by a generator that outlived the learner's restart) and a-2's first 5 do not
    assert c.roster.since_heard == (15 + 5, 3 * (15 + 5))


def test_a_request_held_from_before_a_goodbye_does_not_bring_the_generator_back():
    """A draining generator's version watch may still be held when its goodbye arrives: answered later (at its
    deadline), it is told to stop and the generator stays forgotten, its process's later requests too."""
    c = make()

    def request(**fields) -> WorkRequest:
        return WorkRequest(generator_id="d", weight_version=0, incarnation="d-1", **fields)

    assert c.handle_work(request(max_groups=1)).tickets
    watch = request(max_groups=0, wait_s=1.0)
    assert c.handle_work(watch, final=False) is None  # held: nothing newer than v0
    assert c.handle_work(request(max_groups=0, leaving=True)).stop
    assert "d" not in c.roster.status
    assert c.handle_work(watch, final=True).stop  # its deadline
    assert "d" not in c.roster.status
    # A new process under the same id is a new generator, and welcome.
    assert c.handle_work(WorkRequest(generator_id="d", weight_version=0, incarnation="d-2", max_groups=1)).tickets
    assert c.roster.status["d"].incarnation == "d-2"
