"""The Redis stream buffer against a real ``redis-server`` (see ``redis_server.py``)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
import redis
from conftest import FakeClock
from redis_server import RedisServer, free_port, redis_server  # noqa: F401 (fixture)

from asyncrl.config import BufferConfig
from asyncrl.wire.protocol import SCHEMA_VERSION, Rollout, RolloutLimits, WeightUpdate, encode
from buffers.base import BufferTimeout
from buffers.redis_buffer import FIELD, _entries
from buffers.redis_connection import OutageWait, RedisOutage
from buffers.redis_reader import RedisReader
from buffers.redis_writer import RedisWriter

STREAM = "test:rollouts"
GROUP = "learners"


def make_rollout(i: int, *, prompt_len: int = 4, response_len: int = 3, version: int = 0) -> Rollout:
    """A valid rollout whose id, group and tokens are derived from ``i``."""
    return Rollout(
        rollout_id=f"r{i}",
        group_id=f"g{i // 4}",
        group_size=4,
        prompt_index=i // 4,
        prompt_ids=[(i + k) % 1000 for k in range(prompt_len)],
        response_ids=[(7 * i + k) % 1000 for k in range(response_len)],
        logprobs=[-0.5 - 0.01 * k for k in range(response_len)],
        versions=[version] * response_len,
        reward=float(i % 2),
        finish_reason="stop",
        generator_id="gen-0",
        created_s=1_700_000_000.0 + i,
    )


def make_config(server: RedisServer, **overrides: object) -> BufferConfig:
    fields: dict[str, object] = dict(
        type="redis",
        redis_url=server.url,
        stream=STREAM,
        consumer_group=GROUP,
        consumer="learner-0",
        capacity=1024,
        claim_idle_s=60.0,
        socket_timeout_s=2.0,
        retries=2,
    )
    fields.update(overrides)
    return BufferConfig(**fields)


def client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5)


def ids(rollouts: list[Rollout]) -> list[str]:
    return [r.rollout_id for r in rollouts]


def test_round_trip_preserves_rollouts_and_order(redis_server: RedisServer) -> None:
    config = make_config(redis_server)
    reader, writer = RedisReader(config), RedisWriter(config)
    sent = [make_rollout(i, response_len=1 + i) for i in range(10)]
    writer.put(sent[:6], timeout_s=2)
    writer.put(sent[6:], timeout_s=2)
    got = reader.get(max_items=100, timeout_s=2)
    assert got == sent
    assert reader.get(max_items=100, timeout_s=0) == []
    stats = reader.stats()
    assert stats["received"] == 10 and stats["pending"] == 10 and stats["queued"] == 0
    assert all(isinstance(v, float) for v in stats.values())
    # Stored as one msgpack field per entry, nothing else.
    entries = client(redis_server).xrange(STREAM)
    assert [set(fields) for _, fields in entries] == [{FIELD}] * 10
    writer.close()
    reader.close()


def test_get_respects_max_items(redis_server: RedisServer) -> None:
    config = make_config(redis_server)
    reader, writer = RedisReader(config), RedisWriter(config)
    writer.put([make_rollout(i) for i in range(7)], timeout_s=2)
    assert ids(reader.get(max_items=3, timeout_s=1)) == ["r0", "r1", "r2"]
    assert ids(reader.get(max_items=3, timeout_s=1)) == ["r3", "r4", "r5"]
    assert ids(reader.get(max_items=3, timeout_s=1)) == ["r6"]


def test_ack_removes_from_pending_and_stream(redis_server: RedisServer) -> None:
    config = make_config(redis_server)
    reader, writer = RedisReader(config), RedisWriter(config)
    writer.put([make_rollout(i) for i in range(5)], timeout_s=2)
    assert len(reader.get(max_items=5, timeout_s=2)) == 5
    reader.ack(["r0", "r2", "r4", "not-a-rollout"])
    redis_client = client(redis_server)
    pending = redis_client.xpending(STREAM, GROUP)
    assert pending["pending"] == 2
    assert {entry["message_id"] for entry in redis_client.xpending_range(STREAM, GROUP, "-", "+", 10)} == {
        entry_id for entry_id, fields in redis_client.xrange(STREAM)
    }
    assert redis_client.xlen(STREAM) == 2  # acked entries are deleted: the stream is the backlog
    stats = reader.stats()
    assert stats["acked"] == 3 and stats["pending"] == 2 and stats["pending_mine"] == 2 and stats["held"] == 2
    reader.ack(["r0"])  # acking twice is harmless
    assert reader.stats()["acked"] == 3


@pytest.mark.realtime  # 1.2 s: the wait is Redis's BLOCK, in real time
def test_block_is_clamped_below_socket_timeout(redis_server: RedisServer) -> None:
    # A 1.2 s wait with a 0.5 s socket timeout: a single BLOCK 1200 would raise a socket timeout.
    reader = RedisReader(make_config(redis_server, socket_timeout_s=0.5, retries=0))
    start = time.monotonic()
    assert reader.get(max_items=10, timeout_s=1.2) == []
    assert time.monotonic() - start >= 1.1


@pytest.mark.realtime  # 0.3 s: how long an entry has been idle is Redis's own clock
def test_dead_consumer_entries_are_reclaimed(redis_server: RedisServer) -> None:
    writer = RedisWriter(make_config(redis_server))
    writer.put([make_rollout(i) for i in range(4)], timeout_s=2)
    dead = RedisReader(make_config(redis_server, consumer="dead", claim_idle_s=0.2))
    assert len(dead.get(max_items=10, timeout_s=2)) == 4
    dead.close()  # never acks: it "crashed"

    survivor = RedisReader(make_config(redis_server, consumer="survivor", claim_idle_s=0.2))
    assert survivor.get(max_items=10, timeout_s=0) == []  # not idle long enough yet
    writer.put([make_rollout(10)], timeout_s=2)
    time.sleep(0.3)  # past claim_idle_s on Redis's clock (XAUTOCLAIM's min_idle_time)
    got = survivor.get(max_items=10, timeout_s=2)
    assert sorted(ids(got)) == ["r0", "r1", "r10", "r2", "r3"]
    assert survivor.stats()["claimed"] == 4
    consumers = {c["name"]: c["pending"] for c in client(redis_server).xpending(STREAM, GROUP)["consumers"]}
    assert consumers == {b"survivor": 5}
    survivor.ack(ids(got))
    assert client(redis_server).xlen(STREAM) == 0


@pytest.mark.realtime  # 0.3 s: how long an entry has been idle is Redis's own clock
def test_reader_does_not_redeliver_entries_it_still_holds(redis_server: RedisServer) -> None:
    # Held (read, not yet acked) longer than claim_idle_s: the reclaim scan sees them but must skip them.
    config = make_config(redis_server, claim_idle_s=0.1)
    reader, writer = RedisReader(config), RedisWriter(config)
    writer.put([make_rollout(i) for i in range(3)], timeout_s=2)
    assert len(reader.get(max_items=10, timeout_s=2)) == 3
    time.sleep(0.3)  # past claim_idle_s on Redis's clock: the scan finds them idle
    assert reader.get(max_items=10, timeout_s=0) == []
    reader.ack(["r0", "r1", "r2"])
    assert reader.stats()["acked"] == 3 and reader.stats()["claimed"] == 0


def test_restarted_reader_gets_its_unacked_entries_first(redis_server: RedisServer) -> None:
    config = make_config(redis_server, consumer="learner-0")
    writer = RedisWriter(config)
    writer.put([make_rollout(i) for i in range(5)], timeout_s=2)
    first = RedisReader(config)
    assert len(first.get(max_items=5, timeout_s=2)) == 5
    first.ack(["r0", "r1"])
    first.close()  # restart: read r2..r4 but never acked them

    writer.put([make_rollout(i) for i in range(5, 7)], timeout_s=2)
    again = RedisReader(config)
    assert ids(again.get(max_items=100, timeout_s=2)) == ["r2", "r3", "r4", "r5", "r6"]
    assert again.get(max_items=100, timeout_s=0) == []
    again.ack(["r2", "r3", "r4", "r5", "r6"])
    assert client(redis_server).xpending(STREAM, GROUP)["pending"] == 0


def test_malformed_entries_are_rejected_and_dropped(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(redis_server)
    reader = RedisReader(config, RolloutLimits(max_bytes=4096, vocab_size=100))
    redis_client = client(redis_server)
    future = msgspec.structs.replace(make_rollout(99), schema=SCHEMA_VERSION + 1)
    bad = {
        "garbage": {FIELD: b"\x00\xffnot msgpack at all"},
        "schema": {FIELD: encode(future)},
        "type": {FIELD: encode(WeightUpdate(version=3, uri="file:///w"))},
        "missing": {b"x": b"1"},
        "nan": {FIELD: encode(msgspec.structs.replace(make_rollout(5), logprobs=[float("nan")] * 3))},
        "vocab": {FIELD: encode(msgspec.structs.replace(make_rollout(6), response_ids=[5, 4, 10**6]))},
        "huge": {FIELD: encode(msgspec.structs.replace(make_rollout(7), prompt_ids=[1] * 5000))},
    }
    bad_ids = {}
    redis_client.xadd(STREAM, {FIELD: encode(make_rollout(0))})
    bad_ids["garbage"] = redis_client.xadd(STREAM, bad["garbage"])
    redis_client.xadd(STREAM, {FIELD: encode(make_rollout(1))})
    bad_ids["schema"] = redis_client.xadd(STREAM, bad["schema"])
    bad_ids["type"] = redis_client.xadd(STREAM, bad["type"])
    bad_ids["missing"] = redis_client.xadd(STREAM, bad["missing"])
    for name in ("nan", "vocab", "huge"):
        bad_ids[name] = redis_client.xadd(STREAM, bad[name])
    redis_client.xadd(STREAM, {FIELD: encode(make_rollout(2))})

    with caplog.at_level(logging.WARNING):
        got = reader.get(max_items=100, timeout_s=2)
    assert ids(got) == ["r0", "r1", "r2"]
    assert reader.rejections.by_reason == {
        "malformed": 1,
        "invalid_field": 1,
        "schema": 1,
        "wrong_type": 1,
        "non_finite_logprobs": 1,
        "token_out_of_range": 1,
        "oversize": 1,
    }
    # The entries that cannot be read as a rollout are gone, and acked; the good ones wait, and so do the
    # rollouts rejected by their content (nan, vocab, huge), until the learner acknowledges their drops with
    # their groups'
    assert redis_client.xlen(STREAM) == 6 and redis_client.xpending(STREAM, GROUP)["pending"] == 6
    reader.ack([error.rollout_id for error in reader.rejections.drain() if error.rollout_id])
    assert redis_client.xlen(STREAM) == 3 and redis_client.xpending(STREAM, GROUP)["pending"] == 3
    for name, entry_id in bad_ids.items():
        assert entry_id.decode() in caplog.text, name
    assert f"schema version {SCHEMA_VERSION + 1}" in caplog.text and "no 'm' field" in caplog.text
    assert "unexpected message type WeightUpdate" in caplog.text


def test_a_rejected_member_is_read_again_by_a_learner_that_resumes_before_acknowledging_it(
    redis_server: RedisServer,
) -> None:
    """Its group's other members come back after a crash before the checkpoint: it must come back as well (as a
    rejection), or the group would wait for a member that is gone."""
    config = make_config(redis_server)
    reader, writer = RedisReader(config), RedisWriter(config)
    bad = msgspec.structs.replace(make_rollout(1), logprobs=[float("nan")] * 3)
    writer.put([make_rollout(0), bad], timeout_s=2)
    assert ids(reader.get(max_items=10, timeout_s=1)) == ["r0"]
    assert [e.rollout_id for e in reader.rejections.drain()] == ["r1"]
    reader.close()  # the learner dies before its checkpoint: nothing was acknowledged
    resumed = RedisReader(config)
    assert ids(resumed.get(max_items=10, timeout_s=1)) == ["r0"]
    assert [e.rollout_id for e in resumed.rejections.drain()] == ["r1"]
    resumed.ack(["r0", "r1"])  # trained on, and dropped: both go
    assert client(redis_server).xpending(STREAM, GROUP)["pending"] == 0


def test_a_read_whose_reply_is_lost_on_the_wire_is_read_again_from_the_pending_list(
    redis_server: RedisServer,
) -> None:
    """Redis moved the entries to this consumer's pending list, and the reply never arrived: the next read takes
    them from there, not after buffer.claim_idle_s."""
    import redis as redis_py

    config = make_config(redis_server, outage_tolerance_s=30.0)
    reader, writer = RedisReader(config), RedisWriter(config)
    assert reader.get(max_items=10, timeout_s=0) == []
    writer.put([make_rollout(i) for i in range(3)], timeout_s=2)
    parse, lost = reader._new_client.parse_response, []

    def parse_and_lose(connection, command_name, **options):
        reply = parse(connection, command_name, **options)
        if command_name == "XREADGROUP" and not lost:
            lost.append(reply)
            raise redis_py.ConnectionError("connection reset by peer")  # as a socket read would
        return reply

    reader._new_client.parse_response = parse_and_lose
    got = reader.get(max_items=10, timeout_s=0.5) + reader.get(max_items=10, timeout_s=0.5)
    assert lost and ids(got) == ["r0", "r1", "r2"]
    reader.ack(ids(got))
    assert client(redis_server).xpending(STREAM, GROUP)["pending"] == 0


def test_writer_blocks_when_full_and_times_out_with_sent(redis_server: RedisServer) -> None:
    config = make_config(redis_server, capacity=5)
    clock, meanwhile = FakeClock(), []  # what a learner does while the writer sleeps

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        while meanwhile:
            meanwhile.pop()()

    reader, writer = RedisReader(config), RedisWriter(config, clock=clock, sleep=sleep)
    batch = [make_rollout(i) for i in range(8)]
    start = clock()
    with pytest.raises(BufferTimeout, match="stayed full") as info:
        writer.put(batch, timeout_s=0.3)
    assert info.value.sent == 5
    assert clock() - start == pytest.approx(0.3)  # it waited its whole timeout_s
    assert client(redis_server).xlen(STREAM) == 5  # nothing trimmed, nothing extra

    # Read (not acked) entries no longer count: the rest of the batch fits.
    assert len(reader.get(max_items=3, timeout_s=1)) == 3
    writer.put(batch[info.value.sent :], timeout_s=0.3)
    with pytest.raises(BufferTimeout) as info:
        writer.put([make_rollout(50)], timeout_s=0.1)
    assert info.value.sent == 0

    # A writer waiting for room resumes as soon as the reader takes some.
    meanwhile.append(lambda: reader.get(max_items=2, timeout_s=1))
    start = clock()
    writer.put([make_rollout(60), make_rollout(61)], timeout_s=5)
    assert not meanwhile and 0 < clock() - start < 5, "it waited for room, and not in vain"
    assert ids(reader.get(max_items=100, timeout_s=1)) == ["r5", "r6", "r7", "r60", "r61"]


def test_concurrent_writers_never_exceed_capacity(redis_server: RedisServer) -> None:
    config = make_config(redis_server, capacity=20)
    RedisReader(config)  # the group exists, as in a run
    sent: list[int] = []

    def write(w: int) -> None:
        clock = FakeClock()  # a writer that finds no room waits out its 0.3 s at once
        writer = RedisWriter(config, clock=clock, sleep=clock.sleep)
        try:
            writer.put([make_rollout(100 * w + i) for i in range(10)], timeout_s=0.3)
            sent.append(10)
        except BufferTimeout as exc:
            sent.append(exc.sent)
        writer.close()

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(sent) == 20
    assert client(redis_server).xlen(STREAM) == 20


def test_unreachable_redis_gives_a_clear_error() -> None:
    port = free_port()  # nothing listens there
    config = BufferConfig(
        type="redis", redis_url=f"redis://:hunter2@127.0.0.1:{port}/0", socket_timeout_s=1.0, retries=5
    )
    for side in (RedisWriter, RedisReader):
        with pytest.raises(ConnectionError) as info:
            side(config)
        message = str(info.value)
        assert "buffer.redis_url" in message and f"127.0.0.1:{port}" in message
        assert "hunter2" not in message


def test_password_file_and_wrong_password(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", extra_args=("--requirepass", "s3cret")) as server:
        good, wrong = tmp_path / "good", tmp_path / "wrong"
        good.write_text("s3cret\n")
        wrong.write_text("nope\n")
        reader = RedisReader(make_config(server, redis_password_file=str(good)))
        RedisWriter(make_config(server, redis_password_file=str(good))).put([make_rollout(0)], timeout_s=1)
        assert ids(reader.get(max_items=10, timeout_s=1)) == ["r0"]
        with pytest.raises(ConnectionError, match="buffer.redis_password_file"):
            RedisWriter(make_config(server, redis_password_file=str(wrong)))


def test_aof_restart_keeps_unacked_and_forgets_acked(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    try:
        config = make_config(server, consumer="learner-0")
        writer, reader = RedisWriter(config), RedisReader(config)
        writer.put([make_rollout(i) for i in range(6)], timeout_s=2)
        assert len(reader.get(max_items=4, timeout_s=2)) == 4  # r0..r3 read, r4 r5 unread
        reader.ack(["r0", "r1"])
        writer.close()
        reader.close()

        server.stop(hard=True)  # SIGKILL: only what was fsynced survives
        server.start()

        again = RedisReader(config)
        assert ids(again.get(max_items=100, timeout_s=2)) == ["r2", "r3", "r4", "r5"]
        assert again.get(max_items=100, timeout_s=0) == []
        assert client(server).xlen(STREAM) == 4
    finally:
        server.stop()


class Background:
    """``fn()`` in a thread, keeping its result or the error it raised."""

    def __init__(self, fn) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            self.error = exc

    def join(self, timeout_s: float) -> object:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"still running after {timeout_s}s"
        if self.error is not None:
            raise self.error
        return self.result


def test_put_and_get_wait_out_an_outage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        config = make_config(server, outage_tolerance_s=3600.0, socket_timeout_s=1.0, retries=1)
        clock, during, restart = FakeClock(), {}, threading.Lock()

        def sleep(seconds: float) -> None:  # both clients' waits for Redis move one fake clock
            clock.sleep(seconds)
            # Once each client has waited 2 s for Redis, status is asked mid-outage and Redis comes back.
            if min(writer.outage.down_s, reader.outage.down_s) >= 2.0 and restart.acquire(blocking=False):
                during.update(reader.stats())
                server.start()  # same port, same directory

        reader = RedisReader(config, clock=clock, sleep=sleep)
        writer = RedisWriter(config, clock=clock, sleep=sleep)
        writer.put([make_rollout(i) for i in range(5)], timeout_s=2)
        assert ids(reader.get(max_items=5, timeout_s=2)) == ["r0", "r1", "r2", "r3", "r4"]
        reader.ack(["r0", "r1"])  # r2..r4 stay held (pending) across the outage

        with caplog.at_level(logging.WARNING, logger="buffers"):
            server.stop()  # SIGTERM by PID: the AOF keeps the stream and the group
            down_at = clock()
            # put's own timeout_s (the wait for room) is far shorter than the outage: it must not run out.
            put = Background(lambda: writer.put([make_rollout(i) for i in range(5, 10)], timeout_s=0.5))
            get = Background(lambda: reader.get(max_items=100, timeout_s=20))
            put.join(20)
            got = get.join(20)
        assert clock() - down_at >= 2.0 and during, "Redis came back after both had waited 2 s for it"
        while len(got) < 5:  # the five may arrive in more than one read
            more = reader.get(max_items=100, timeout_s=5)
            assert more, f"only {ids(got)} came back"
            got += more
        assert got == [make_rollout(i) for i in range(5, 10)]  # intact, in order, each once
        assert reader.get(max_items=100, timeout_s=0) == []  # nothing redelivered, r2..r4 included

        assert during["redis_outage_s"] >= 2.0 and during["redis_error"] == 1.0 and during["held"] == 3
        stats = reader.stats()
        assert stats["redis_outage_s"] == 0 and stats["redis_outages"] == 1 and "redis_error" not in stats
        assert stats["duplicates"] == 0 and stats["pending"] == 8 and stats["queued"] == 0
        assert writer.outage.outages == 1 and writer.outage.down_s == 0
        reader.ack(ids(got) + ["r2", "r3", "r4"])
        assert client(server).xlen(STREAM) == 0
        # Logged once as it starts and once as it ends, by each of the two clients.
        messages = [r.getMessage() for r in caplog.records]
        assert sum("is unreachable" in m and server.url in m for m in messages) == 2, messages
        assert sum("is back after an outage of" in m for m in messages) == 2, messages
    finally:
        server.stop()


@pytest.mark.realtime  # 0.4 s: a stopped Redis answers nothing, so the one attempt lasts a socket timeout
def test_stats_of_a_redis_that_hangs_ask_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A status query is never held for redis-py's retry schedule, and not at all once the outage is known."""
    server = RedisServer(tmp_path / "redis").start()
    assert server.process is not None
    try:
        config = make_config(server, socket_timeout_s=0.4, retries=5, outage_tolerance_s=30.0)
        reader = RedisReader(config)
        assert reader.stats()["queued"] == 0
        connection = reader._status_client.connection_pool.connection_class
        sends, send = [], connection.send_packed_command
        monkeypatch.setattr(
            connection, "send_packed_command", lambda self, *a, **k: sends.append(1) or send(self, *a, **k)
        )
        server.process.send_signal(signal.SIGSTOP)  # connections are still accepted, nothing is answered
        during = reader.stats()
        # Asked once: all of redis-py's retries would send it 6 times (2.4 s of socket timeouts and their backoff).
        assert len(sends) == 1
        assert during["redis_error"] == 1.0 and during["redis_outages"] == 1
        assert reader.stats()["redis_error"] == 1.0
        assert len(sends) == 1  # known to be down: not asked
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()


def test_ack_waits_out_an_outage(tmp_path: Path) -> None:
    # At a checkpoint the learner acks what it trained on: an outage there must delay the ack, not lose it.
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        config = make_config(server, outage_tolerance_s=30.0, socket_timeout_s=1.0, retries=1)
        clock, waited = FakeClock(), []

        def sleep(seconds: float) -> None:
            clock.sleep(seconds)
            if reader.outage.down_s >= 1.5 and not waited:  # the ack is still waiting 1.5 s in: Redis comes back
                waited.append(reader.outage.down_s)
                server.start()

        reader, writer = RedisReader(config, clock=clock, sleep=sleep), RedisWriter(config)
        writer.put([make_rollout(i) for i in range(3)], timeout_s=2)
        assert len(reader.get(max_items=3, timeout_s=2)) == 3
        server.stop()
        reader.ack(["r0", "r1", "r2"])
        assert waited, "ack returned while Redis was down"
        stats = reader.stats()
        assert stats["acked"] == 3 and stats["held"] == 0 and stats["pending"] == 0 and stats["redis_outages"] == 1
        assert client(server).xlen(STREAM) == 0
    finally:
        server.stop()


@pytest.mark.realtime  # about 1 s: the read that comes back empty is a BLOCK in Redis, in real time
def test_a_read_whose_reply_was_lost_is_read_again(redis_server: RedisServer) -> None:
    # XREADGROUP > went through (the entries are now pending for this consumer) but its reply was lost.
    config = make_config(redis_server, outage_tolerance_s=30.0)
    reader, writer = RedisReader(config), RedisWriter(config)
    assert reader.get(max_items=10, timeout_s=0) == []  # the reader's own history pass is done
    writer.put([make_rollout(i) for i in range(3)], timeout_s=2)
    real_read = reader._new_client.xreadgroup
    lost = []

    def read_and_lose_the_reply(*args, **kwargs):
        reply = real_read(*args, **kwargs)
        if not lost:
            lost.append(reply)
            raise redis.ConnectionError("connection reset by peer")
        return reply

    reader._new_client.xreadgroup = read_and_lose_the_reply
    assert reader.get(max_items=10, timeout_s=0.5) == []  # the retry finds no new entries
    assert lost and len(_entries(lost[0])) == 3
    assert ids(reader.get(max_items=10, timeout_s=1)) == ["r0", "r1", "r2"]  # from the pending list
    assert reader.get(max_items=10, timeout_s=0) == []
    assert reader.stats()["redis_outages"] == 1


def test_a_retried_add_that_went_through_is_delivered_once(redis_server: RedisServer) -> None:
    # The script added the batch but its reply was lost: put sends it again, the reader keeps one copy.
    config = make_config(redis_server, outage_tolerance_s=30.0)
    clock = FakeClock()  # the pause before put tries again
    reader, writer = RedisReader(config), RedisWriter(config, clock=clock, sleep=clock.sleep)
    real_add = writer._add
    lost = []

    def add_and_lose_the_reply(**kwargs):
        reply = real_add(**kwargs)
        if not lost:
            lost.append(reply)
            raise redis.ConnectionError("connection reset by peer")
        return reply

    writer._add = add_and_lose_the_reply
    writer.put([make_rollout(i) for i in range(3)], timeout_s=1)
    assert lost and client(redis_server).xlen(STREAM) == 6
    assert ids(reader.get(max_items=10, timeout_s=1)) == ["r0", "r1", "r2"]
    assert reader.get(max_items=10, timeout_s=0) == []
    stats = reader.stats()
    assert stats["duplicates"] == 3 and stats["stream_length"] == 3  # the copies are acked and deleted
    assert writer.outage.outages == 1


def test_put_outage_time_is_not_buffer_full_time_and_sent_is_kept(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        config = make_config(server, capacity=5, outage_tolerance_s=30.0, socket_timeout_s=1.0, retries=1)
        RedisReader(config)  # the group exists
        clock, restarted = FakeClock(), []

        def sleep(seconds: float) -> None:
            clock.sleep(seconds)
            if writer.outage.down_s >= 1.5 and not restarted:  # Redis comes back after 1.5 s
                restarted.append(clock())
                server.start()

        writer = RedisWriter(config, clock=clock, sleep=sleep)
        server.stop()
        start = clock()
        with pytest.raises(BufferTimeout, match="stayed full") as info:
            writer.put([make_rollout(i) for i in range(8)], timeout_s=0.5)
        # 1.5 s down, then full for the whole 0.5 s: the outage did not use up timeout_s.
        assert restarted[0] - start >= 1.5 and clock() - restarted[0] >= 0.5
        assert info.value.sent == 5
        assert client(server).xlen(STREAM) == 5
    finally:
        server.stop()


def test_outage_past_the_tolerance_is_a_clear_error(redis_server: RedisServer) -> None:
    config = make_config(redis_server, outage_tolerance_s=1.0, socket_timeout_s=1.0, retries=1)
    clock = FakeClock()
    reader = RedisReader(config, clock=clock, sleep=clock.sleep)
    writer = RedisWriter(config, clock=clock, sleep=clock.sleep)
    redis_server.stop()

    # Within the tolerance, get hands back nothing at its own timeout, and status shows the outage.
    start = clock()
    assert reader.get(max_items=10, timeout_s=0.2) == []
    assert clock() - start == pytest.approx(0.2)
    stats = reader.stats()
    assert stats["redis_outage_s"] > 0 and stats["redis_outages"] == 1 and stats["redis_error"] == 1.0

    with pytest.raises(RedisOutage, match=r"buffer\.outage_tolerance_s=1\b") as info:
        reader.get(max_items=10, timeout_s=30)  # its own timeout is not what ends the wait
    assert clock() - start == pytest.approx(1.0)
    assert f"127.0.0.1:{redis_server.port}" in str(info.value)
    assert isinstance(info.value, ConnectionError)

    start = clock()
    with pytest.raises(RedisOutage, match=r"buffer\.outage_tolerance_s"):
        writer.put([make_rollout(0)], timeout_s=30)
    assert clock() - start == pytest.approx(1.0)  # the writer's own outage: from its first failure
    for _ in range(3):  # stats never raises
        assert reader.stats()["redis_error"] == 1.0


def test_outage_messages_never_show_the_password(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    config = BufferConfig(type="redis", redis_url="redis://:hunter2@127.0.0.1:1/0", outage_tolerance_s=0.3)
    outage = OutageWait(config, clock=clock, sleep=clock.sleep)

    def refused() -> None:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    with caplog.at_level(logging.WARNING), pytest.raises(RedisOutage) as info:
        outage.call(refused)
    assert "127.0.0.1:1" in str(info.value) and ":***@" in str(info.value)
    assert "hunter2" not in str(info.value) and "hunter2" not in caplog.text and ":***@" in caplog.text
    assert outage.outages == 1 and outage.failures >= 2
