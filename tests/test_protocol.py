import msgspec
import pytest

from asyncrl.protocol import (
    SCHEMA_VERSION, PromptTicket, ProtocolError, Rollout, Status, WeightUpdate, WorkReply, WorkRequest, decode, encode,
)
from conftest import make_rollout


def test_every_message_round_trips():
    messages = [
        make_rollout(versions=[3, 3, 4]),
        WeightUpdate(version=7, uri="file:///dev/shm/v7", num_bytes=10),
        WorkRequest(generator_id="g", weight_version=2, max_groups=4),
        WorkReply(tickets=[PromptTicket(1, "s-g1")], latest=WeightUpdate(version=1, uri="file:///x")),
        Status(step=1, total_steps=2, version=1, max_staleness=1, samples_consumed=3, samples_dropped={"stale": 1},
               samples_admitted=4, buffer={"received": 3.0}, generators=[]),
    ]
    for message in messages:
        assert decode(encode(message)) == message


def test_rollout_knows_its_oldest_version():
    assert make_rollout(versions=[5, 4, 6]).oldest_version == 4


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"\xc1garbage", "malformed"),
        (msgspec.msgpack.encode({"type": "nonsense"}), "malformed"),
        (msgspec.msgpack.encode({"type": "weights", "version": "seven", "uri": "x"}), "version"),
        (msgspec.msgpack.encode({"type": "weights", "version": 1}), "uri"),
        (msgspec.msgpack.encode({"type": "weights", "version": 1, "uri": "x", "extra": 1}), "extra"),
        (msgspec.msgpack.encode({"type": "weights", "version": 1, "uri": "x", "schema": SCHEMA_VERSION + 1}), "schema"),
    ],
)
def test_bad_messages_are_rejected_with_a_reason(data, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(data)


def test_rollout_with_inconsistent_lengths_is_rejected():
    good = msgspec.to_builtins(make_rollout())
    good["logprobs"] = good["logprobs"][:-1]
    with pytest.raises(ProtocolError, match="one entry per token"):
        decode(msgspec.msgpack.encode(good))


def test_unexpected_type_is_rejected():
    with pytest.raises(ProtocolError, match="unexpected message type"):
        decode(encode(WeightUpdate(version=1, uri="x")), Rollout)


def test_protocol_imports_no_training_stack(python):
    import subprocess

    code = "import sys, asyncrl.protocol; print(sorted(m for m in ('torch','vllm','deepspeed') if m in sys.modules))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
