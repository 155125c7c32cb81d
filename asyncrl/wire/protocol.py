"""Every message that crosses a process boundary, as msgspec Structs: the one module to import them from.

This module imports neither torch nor vLLM nor DeepSpeed, so a buffer, a
status client or a generator on another machine can speak the protocol
without pulling in a training stack. Nothing on the wire is pickled: messages
are msgpack-encoded Structs, tagged by type and stamped with
``SCHEMA_VERSION``. :func:`decode` validates every field; anything malformed
raises :class:`ProtocolError`, which receivers count and skip.

The types are defined by concern, in :mod:`~asyncrl.wire.rollouts` (the data
plane), :mod:`~asyncrl.wire.control` (work, evaluations, status, step orders)
and :mod:`~asyncrl.wire.weights` (versions and how they travel), on the base in
:mod:`~asyncrl.wire.schema`; this module gathers them, and encodes and decodes.
"""

from __future__ import annotations

import time

import msgspec

from asyncrl.wire.control import (
    Ack,
    ErrorReply,
    EvalReport,
    EvalTicket,
    EvalTrace,
    GeneratorStatus,
    PromptTicket,
    Status,
    StatusRequest,
    StepOrder,
    WorkReply,
    WorkRequest,
)
from asyncrl.wire.rollouts import EpisodeStats, Rollout, RolloutLimits
from asyncrl.wire.schema import SCHEMA_VERSION, Count, ProtocolError, Seconds
from asyncrl.wire.weights import Manifest, SharedHandle, TensorSpec, WeightChunk, WeightFetch, WeightUpdate

__all__ = [
    "SCHEMA_VERSION",
    "Ack",
    "Count",
    "EpisodeStats",
    "ErrorReply",
    "EvalReport",
    "EvalTicket",
    "EvalTrace",
    "GeneratorStatus",
    "Manifest",
    "Message",
    "PromptTicket",
    "ProtocolError",
    "Rollout",
    "RolloutLimits",
    "Seconds",
    "SharedHandle",
    "Status",
    "StatusRequest",
    "StepOrder",
    "TensorSpec",
    "WeightChunk",
    "WeightFetch",
    "WeightUpdate",
    "WorkReply",
    "WorkRequest",
    "decode",
    "decode_rollout",
    "encode",
    "now_s",
]

Message = (
    Rollout
    | WeightUpdate
    | WorkRequest
    | WorkReply
    | StatusRequest
    | Status
    | ErrorReply
    | WeightFetch
    | WeightChunk
    | EvalReport
    | Ack
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Serialize one message to msgpack bytes."""
    return _encoder.encode(message)


def decode(data: bytes, expected: type | tuple[type, ...] | None = None) -> Message:
    """Decode and validate one message.

    Raises :class:`ProtocolError` naming what was wrong: undecodable bytes
    (``malformed``), a field of the wrong type or an unknown one
    (``invalid_field``), a wrong schema version (``schema``), or a type other
    than ``expected`` (``wrong_type``).
    """
    try:
        message = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        schema = _schema_of(data)
        if schema is not None and schema != SCHEMA_VERSION:  # a newer (or older) sender's fields, not bad ones
            raise ProtocolError(
                f"a message of schema version {schema}; this build speaks {SCHEMA_VERSION} ({exc})", "schema"
            ) from exc
        raise ProtocolError(f"invalid message ({len(data)} bytes): {exc}", "invalid_field") from exc
    except Exception as exc:  # noqa: BLE001  (bytes from the wire: nesting past the recursion limit included)
        raise ProtocolError(f"malformed message ({len(data)} bytes): {type(exc).__name__}: {exc}", "malformed") from exc
    if message.schema != SCHEMA_VERSION:
        raise ProtocolError(
            f"{type(message).__name__} has schema version {message.schema}; this build speaks {SCHEMA_VERSION}",
            "schema",
        )
    if expected is not None and not isinstance(message, expected):
        raise ProtocolError(f"unexpected message type {type(message).__name__}", "wrong_type")
    return message


class _Schema(msgspec.Struct):
    schema: int = SCHEMA_VERSION


_schema_decoder = msgspec.msgpack.Decoder(_Schema)


def _schema_of(data: bytes) -> int | None:
    """The schema version a message says it has, whatever its other fields; None if it cannot be read."""
    try:
        return _schema_decoder.decode(data).schema
    except Exception:  # noqa: BLE001  (whatever the bytes are, this only reads what it can)
        return None


def decode_rollout(data: bytes, limits: RolloutLimits) -> Rollout:
    """Decode one buffer entry and check it fully; raises :class:`ProtocolError` with a reason.

    The size cap comes first, so an oversized entry is never decoded.
    """
    if len(data) > limits.max_bytes:
        ids = _ids_of(data)
        raise ProtocolError(
            f"entry of {len(data)} bytes{f' (rollout {ids.rollout_id})' if ids else ''} exceeds "
            f"buffer.max_message_bytes ({limits.max_bytes})",
            "oversize",
            ids.rollout_id if ids else "",
            ids.group_id if ids else "",
        )
    rollout = decode(data, Rollout)
    problem = rollout.problem(limits.vocab_size)
    if problem is not None:
        reason, detail = problem
        raise ProtocolError(f"rollout {rollout.rollout_id}: {detail}", reason, rollout.rollout_id, rollout.group_id)
    return rollout


class _RolloutIds(msgspec.Struct):
    type: str = ""
    rollout_id: str = ""
    group_id: str = ""


def _ids_of(data: bytes) -> _RolloutIds | None:
    """The ids of an oversized rollout, read without building its lists (msgspec skips unknown fields)."""
    try:
        ids = msgspec.msgpack.decode(data, type=_RolloutIds)
    except Exception:  # noqa: BLE001
        return None
    return ids if ids.type == "rollout" and ids.group_id else None


def now_s() -> float:
    """Wall-clock seconds, the time base of every ``*_s`` timestamp."""
    return time.time()
