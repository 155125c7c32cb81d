import msgspec
import pytest
from conftest import make_rollout

from asyncrl.wire.protocol import (
    SCHEMA_VERSION,
    PromptTicket,
    ProtocolError,
    Rollout,
    RolloutLimits,
    Status,
    WeightUpdate,
    WorkReply,
    WorkRequest,
    decode,
    decode_rollout,
    encode,
)


def test_every_message_round_trips():
    messages = [
        make_rollout(versions=[3, 3, 4]),
        WeightUpdate(version=7, uri="file:///dev/shm/v7", num_bytes=10),
        WorkRequest(generator_id="g", weight_version=2, max_groups=4),
        WorkReply(tickets=[PromptTicket(1, "s-g1")], latest=WeightUpdate(version=1, uri="file:///x")),
        Status(
            step=1,
            total_steps=2,
            version=1,
            max_staleness=1,
            samples_consumed=3,
            samples_dropped={"stale": 1},
            samples_admitted=4,
            buffer={"received": 3.0},
            generators=[],
        ),
    ]
    for message in messages:
        assert decode(encode(message)) == message


def test_a_peer_of_the_previous_schema_is_named_as_such():
    # Schema 5 reported no written groups: a learner of this build would have a lost generator's finished
    # groups generated again.
    old = msgspec.msgpack.encode(
        {"type": "work_request", "generator_id": "g", "weight_version": 0, "max_groups": 1, "schema": 5}
    )
    with pytest.raises(ProtocolError, match="schema version 5; this build speaks 6") as error:
        decode(old)
    assert error.value.reason == "schema"


def test_rollout_knows_its_oldest_version():
    assert make_rollout(versions=[5, 4, 6]).oldest_version == 4


@pytest.mark.parametrize(
    "data, needle, reason",
    [
        (b"\xc1garbage", "malformed", "malformed"),
        # 300 KB of maps nested 100,000 deep: past the recursion limit (even one a library raised, as some
        # do on import), and no receiver may die of it
        (b"\x81\xa1a" * 100_000 + b"\xc0", "RecursionError", "malformed"),
        (msgspec.msgpack.encode({"type": "nonsense"}), r"\$\.type", "invalid_field"),
        (msgspec.msgpack.encode({"type": "weights", "version": "seven", "uri": "x"}), "version", "invalid_field"),
        (msgspec.msgpack.encode({"type": "weights", "uri": "x"}), "version", "invalid_field"),
        (
            msgspec.msgpack.encode({"type": "weights", "version": 1, "transport": "carrier-pigeon"}),
            "transport",
            "invalid_field",
        ),
        (msgspec.msgpack.encode({"type": "weights", "version": 1, "uri": "x", "extra": 1}), "extra", "invalid_field"),
        (
            msgspec.msgpack.encode({"type": "weights", "version": 1, "uri": "x", "schema": SCHEMA_VERSION + 1}),
            "schema",
            "schema",
        ),
        # a negative count would hand slots back to the staleness bound: 1,048 groups were granted for 48
        (
            msgspec.msgpack.encode(
                {"type": "work_request", "generator_id": "g", "weight_version": 0, "max_groups": -1000}
            ),
            r"`int` >= 0 - at `\$\.max_groups`",
            "invalid_field",
        ),
        # a newer sender's new field: its schema is what the receiver reports, not the field
        (
            msgspec.msgpack.encode(
                {"type": "weights", "version": 1, "uri": "x", "schema": SCHEMA_VERSION + 1, "added_later": 1}
            ),
            f"schema version {SCHEMA_VERSION + 1}",
            "schema",
        ),
    ],
)
def test_bad_messages_are_rejected_with_a_reason(data, needle, reason):
    with pytest.raises(ProtocolError, match=needle) as caught:
        decode(data)
    assert caught.value.reason == reason


def _tampered(**fields):
    data = msgspec.to_builtins(make_rollout())
    data.update(fields)
    return msgspec.msgpack.encode(data)


@pytest.mark.parametrize(
    "fields, reason, needle",
    [
        ({"logprobs": [-0.5, float("nan"), -0.5]}, "non_finite_logprobs", r"logprobs\[1\] = nan"),
        ({"logprobs": [-0.5, float("-inf"), -0.5]}, "non_finite_logprobs", r"logprobs\[1\] = -inf"),
        ({"logprobs": [-0.5, 3.0, -0.5]}, "non_finite_logprobs", r"logprobs\[1\] = 3.0"),
        ({"reward": float("nan")}, "non_finite_reward", "reward = nan"),
        ({"reward": float("inf")}, "non_finite_reward", "reward = inf"),
        ({"response_ids": [5, 4, 100]}, "token_out_of_range", r"token id 100 outside \[0, 100\)"),
        ({"prompt_ids": [1, -3]}, "token_out_of_range", "token id -3"),
        ({"logprobs": [-0.5, -0.5]}, "length_mismatch", r"one entry per token \(3, 2, 3\)"),
        ({"response_ids": [], "logprobs": [], "versions": []}, "empty_response", "response_ids is empty"),
        ({"prompt_ids": []}, "empty_prompt", "prompt_ids is empty"),
        ({"group_size": 0}, "invalid_field", "group_size"),
        ({"versions": [0, -1, 0]}, "invalid_field", "versions"),
    ],
)
def test_a_rollout_that_must_not_reach_the_loss_is_rejected_naming_the_field(fields, reason, needle):
    with pytest.raises(ProtocolError, match=needle) as caught:
        decode_rollout(_tampered(**fields), RolloutLimits(max_bytes=2**20, vocab_size=100))
    assert caught.value.reason == reason
    assert caught.value.group_id == "s-g0" and caught.value.rollout_id == "s-g0-0"  # its group can be let go


def test_a_valid_rollout_passes_and_an_oversized_one_is_never_decoded():
    data = encode(make_rollout())
    assert decode_rollout(data, RolloutLimits(max_bytes=len(data), vocab_size=14)) == make_rollout()
    with pytest.raises(ProtocolError, match=f"{len(data)} bytes \\(rollout s-g0-0\\) exceeds") as caught:
        decode_rollout(data, RolloutLimits(max_bytes=len(data) - 1))
    assert caught.value.reason == "oversize" and caught.value.group_id == "s-g0"  # read without decoding the lists
    with pytest.raises(ProtocolError) as caught:
        decode_rollout(b"\xc1" * 100, RolloutLimits(max_bytes=10))
    assert caught.value.reason == "oversize" and caught.value.group_id == ""


def test_unexpected_type_is_rejected():
    with pytest.raises(ProtocolError, match="unexpected message type") as caught:
        decode(encode(WeightUpdate(version=1, uri="x")), Rollout)
    assert caught.value.reason == "wrong_type"


def test_protocol_imports_no_training_stack(python):
    import subprocess

    code = (
        "import sys, asyncrl.wire.protocol; print(sorted(m for m in ('torch','vllm','deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
