import threading
import time

import pytest
import zmq
from conftest import make_rollout, wait_for

from asyncrl.config import BufferConfig
from asyncrl.wire.protocol import encode
from asyncrl.wire.sockets import Endpoint
from buffers import BufferTimeout, open_reader, open_writer


@pytest.fixture(params=["zmq", "inproc"])
def config(request, tcp_address):
    address = tcp_address if request.param == "zmq" else f"queue-{time.monotonic_ns()}"
    return BufferConfig(type=request.param, address=address, capacity=8, timeout_s=1.0)


def test_round_trip_in_order(config):
    reader = open_reader(config)
    writer = open_writer(config)
    try:
        sent = [make_rollout(i) for i in range(5)]
        writer.put(sent, timeout_s=2)
        got = []
        while len(got) < 5:
            chunk = reader.get(max_items=10, timeout_s=2)
            assert chunk, "timed out waiting for rollouts"
            got += chunk
        assert got == sent
        assert reader.get(max_items=10, timeout_s=0) == []
    finally:
        writer.close()
        reader.close()


@pytest.mark.realtime  # 0.5 s: the wait for room is a socket poll (zmq) or a queue's wait (inproc), in real time
def test_writer_blocks_then_times_out_when_nobody_reads(config):
    reader = open_reader(config)  # bound but never read
    writer = open_writer(config)
    try:
        batch = [make_rollout(i) for i in range(20_000)]
        with pytest.raises(BufferTimeout) as err:
            writer.put(batch, timeout_s=0.5)
        # Everything before the failure went in; a retry sends the rest only. ZeroMQ's
        # queues hold `capacity` per side, the kernel's TCP buffers some more.
        if config.type == "inproc":
            assert err.value.sent == config.capacity
        else:
            assert config.capacity < err.value.sent < len(batch)
    finally:
        writer.close()
        reader.close()


def test_backpressure_releases_when_the_reader_drains(config):
    reader = open_reader(config)
    writer = open_writer(config)
    received = []

    def drain():
        # The learner starts reading once the writer has filled what it reads from. Real time: this polls for
        # the writer's thread (and for zmq, the reader's receiving thread) to get there.
        wait_for(lambda: max(reader.stats().get(k, 0) for k in ("queued", "decoded_waiting")) >= config.capacity)
        while len(received) < 100:
            received.extend(reader.get(max_items=16, timeout_s=2))

    thread = threading.Thread(target=drain)
    thread.start()
    try:
        writer.put([make_rollout(i) for i in range(100)], timeout_s=10)
        thread.join(timeout=10)
        assert [r.rollout_id for r in received] == [make_rollout(i).rollout_id for i in range(100)]
    finally:
        writer.close()
        reader.close()


def test_a_zmq_writer_closed_with_linger_delivers_what_it_had_queued(tcp_address):
    config = BufferConfig(type="zmq", address=tcp_address, capacity=8, timeout_s=5.0)
    reader = open_reader(config)
    writer = open_writer(config)
    sent = [make_rollout(i, group=f"s-g{i}", n_tokens=20_000) for i in range(40)]  # ~200 KB each
    got = []

    def learner():
        deadline = time.monotonic() + 20  # real time: the writer's closing thread and the reader's receiving one
        while len(got) < len(sent) and time.monotonic() < deadline:
            got.extend(reader.get(max_items=4, timeout_s=0.5))

    try:
        for i in range(0, 40, 2):  # put() returns once the frames are queued in this process
            writer.put(sent[i : i + 2], timeout_s=5)
        closer = threading.Thread(target=writer.close, kwargs={"linger_s": 10.0})
        closer.start()  # a drained generator's close: what is still queued must not be thrown away
        # The learner is busy with a step meanwhile: it reads only once the socket is closed, with frames queued.
        wait_for(lambda: writer._endpoint.socket.closed, timeout_s=10)
        learner()
        closer.join()
        assert [r.rollout_id for r in got] == [r.rollout_id for r in sent]
    finally:
        writer.close()
        reader.close()


def test_zmq_reader_rejects_and_counts_garbage(tcp_address):
    config = BufferConfig(type="zmq", address=tcp_address, capacity=8)
    reader = open_reader(config)
    raw = Endpoint(zmq.PUSH, tcp_address, bind=False, field="test")
    writer = open_writer(config)
    try:
        raw.socket.send(b"not msgpack at all")
        raw.socket.send(b"\x81\xa4type\xa7weights")  # a valid frame of the wrong kind
        writer.put([make_rollout(7)], timeout_s=1)
        got = []
        deadline = time.monotonic() + 5  # two peers: their frames may arrive in either order, in real time
        while (not got or reader.rejections.total < 2) and time.monotonic() < deadline:
            got += reader.get(max_items=10, timeout_s=0.5)
        assert [r.rollout_id for r in got] == [make_rollout(7).rollout_id]
        assert reader.rejections.total == 2
        assert reader.stats()["rejected"] == 2
    finally:
        raw.close()
        writer.close()
        reader.close()


def test_binding_beyond_loopback_requires_a_secret():
    with pytest.raises(ValueError, match="buffer.address.*curve_secret_file"):
        open_reader(BufferConfig(type="zmq", address="tcp://0.0.0.0:5999"))


def test_bad_address_names_the_field(tcp_address):
    with pytest.raises(ValueError, match="buffer.address"):
        open_reader(BufferConfig(type="zmq", address="ipc:///tmp/x"))
    with pytest.raises(ValueError, match="buffer.address: Port out of range"):
        open_reader(BufferConfig(type="zmq", address="tcp://127.0.0.1:70000"))
    first = open_reader(BufferConfig(type="zmq", address=tcp_address))
    try:
        with pytest.raises(RuntimeError, match=f"buffer.address: cannot bind {tcp_address}: Address already in use"):
            open_reader(BufferConfig(type="zmq", address=tcp_address))
    finally:
        first.close()


@pytest.mark.realtime  # 0.5 s: that the outsiders' frames never arrive is seen by waiting for them
def test_curve_secret_admits_holders_only(tmp_path):
    from conftest import free_port

    from asyncrl.wire.sockets import _load_keys, create_certificate

    secret = str(create_certificate(tmp_path / "keys" / "run"))
    # Another run's key, kept in the same folder: the server's public key is no secret, so a client could know it.
    other = str(create_certificate(tmp_path / "keys" / "other-run"))
    address = f"tcp://127.0.0.1:{free_port()}"
    config = BufferConfig(type="zmq", address=address, capacity=8, curve_secret_file=secret)
    reader = open_reader(config)
    writer = open_writer(config)
    outsider = open_writer(BufferConfig(type="zmq", address=address, capacity=8))  # no secret
    context = zmq.Context()
    intruder = context.socket(zmq.PUSH)
    intruder.curve_publickey, intruder.curve_secretkey = _load_keys(other)
    intruder.curve_serverkey = _load_keys(secret)[0]
    intruder.connect(address)
    try:
        outsider.put([make_rollout(1)], timeout_s=0.5)
        intruder.send(encode(make_rollout(3)))
        writer.put([make_rollout(2)], timeout_s=1)
        got = []
        deadline = time.monotonic() + 5  # real time: the reader's thread receiving
        while time.monotonic() < deadline and len(got) < 1:
            got += reader.get(max_items=10, timeout_s=0.5)
        got += reader.get(max_items=10, timeout_s=0.5)  # and nothing else comes
        assert [r.rollout_id for r in got] == [make_rollout(2).rollout_id]
    finally:
        intruder.close(linger=0)
        context.destroy(linger=0)
        outsider.close()
        writer.close()
        reader.close()


def test_a_writer_with_no_buffer_to_reach_says_why_it_could_not_hand_rollouts_over(tcp_address):
    writer = open_writer(BufferConfig(type="zmq", address=tcp_address, capacity=8))  # nothing listens there
    try:
        with pytest.raises(BufferTimeout, match=r"\(buffer.address\) stayed full for 0.5s: no connection: nothing"):
            writer.put([make_rollout(i) for i in range(200)], timeout_s=0.5)  # past what it queues unconnected
    finally:
        writer.close()
