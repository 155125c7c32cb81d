"""Every message that crosses a process boundary, as msgspec Structs.

This module imports neither torch nor vLLM nor DeepSpeed, so a buffer, a
status client or a generator on another machine can speak the protocol
without pulling in a training stack. Nothing on the wire is pickled: messages
are msgpack-encoded Structs, tagged by type and stamped with
``SCHEMA_VERSION``. :func:`decode` validates every field; anything malformed
raises :class:`ProtocolError`, which receivers count and skip.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Literal

import msgspec

# 3: Rollout.reward_failed; 4: weight sessions, refused tickets, WeightFetch.wait_s; 5: WorkRequest.request_id,
# EvalTrace.label; 6: WorkRequest.written, EvalTrace.reward_failed
SCHEMA_VERSION = 6


class ProtocolError(ValueError):
    """A message that could not be decoded or failed validation.

    ``reason`` is a short key receivers count by (``malformed``,
    ``non_finite_logprobs``...); the message names the field and the values.
    """

    def __init__(self, message: str, reason: str = "malformed", rollout_id: str = "", group_id: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        # Set when the entry was a rollout whose ids could be read: its group can be let go at once.
        self.rollout_id, self.group_id = rollout_id, group_id


class _Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    schema: int = SCHEMA_VERSION


class Rollout(_Message, tag="rollout"):
    """One sampled response to one prompt, with everything the learner needs.

    ``logprobs[i]`` is the behaviour log-prob of ``response_ids[i]`` under the
    weights of version ``versions[i]``: a weight update that lands while the
    sequence is generated shows up as a change of version mid-sequence.
    """

    rollout_id: str
    group_id: str
    group_size: int
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    finish_reason: str
    generator_id: str
    created_s: float
    generate_s: float = 0.0
    reward_failed: bool = False  # the reward raised, was not a finite number or timed out; ``reward`` is then 0

    def problem(self, vocab_size: int | None = None) -> tuple[str, str] | None:
        """``(reason, detail)`` if this rollout must not be trained on, else None.

        Receivers call it on every rollout, valid ticket or not: one NaN
        log-prob or reward poisons a whole step's loss, and a token id past
        the vocabulary crashes the learner's embedding lookup.
        """
        n = len(self.response_ids)
        if n == 0:
            return "empty_response", "response_ids is empty"
        if len(self.logprobs) != n or len(self.versions) != n:
            return "length_mismatch", (
                f"response_ids, logprobs and versions must have one entry per token "
                f"({n}, {len(self.logprobs)}, {len(self.versions)})"
            )
        if not self.prompt_ids:
            return "empty_prompt", "prompt_ids is empty"
        if self.group_size < 1:
            return "invalid_field", f"group_size must be >= 1, got {self.group_size}"
        # One pass each in C: a NaN or inf anywhere makes the sum non-finite.
        if not math.isfinite(sum(self.logprobs)) or max(self.logprobs) > 1e-3:
            bad = next((i for i, x in enumerate(self.logprobs) if not (math.isfinite(x) and x <= 1e-3)), -1)
            return "non_finite_logprobs", f"logprobs[{bad}] = {self.logprobs[bad]!r} (must be finite and <= 0)"
        if not math.isfinite(self.reward):
            return "non_finite_reward", f"reward = {self.reward!r}"
        if min(self.versions) < 0:
            return "invalid_field", f"versions holds {min(self.versions)} (must be >= 0)"
        low = min(min(self.prompt_ids), min(self.response_ids))
        high = max(max(self.prompt_ids), max(self.response_ids))
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad_value = low if low < 0 else high
            return "token_out_of_range", f"token id {bad_value} outside [0, {vocab_size})"
        return None

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among this rollout's tokens."""
        return min(self.versions)


class SharedHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to open a learner's shared-memory weight segment (:mod:`asyncrl.weights.shared`) on this machine."""

    kind: Literal["cuda", "file"]
    nbytes: int
    path: str = ""  # file: the segment's file
    # cuda: the physical GPU (its UUID, so that each process's CUDA_VISIBLE_DEVICES numbering does not
    # matter) and the storage's IPC handle, as torch.UntypedStorage._share_cuda_() returns it
    gpu_uuid: str = ""
    cuda_ipc: tuple[int, bytes, int, int, bytes, int, bytes, bool] | None = None


class WeightUpdate(_Message, tag="weights"):
    """Announces that policy version ``version`` can be loaded, and how it travels.

    ``transport`` is ``folder`` (an HF folder at ``uri``, ``file://``, which
    appears only once every byte of it is in place), ``served`` (the same
    folder, fetched over ZeroMQ from the learner), ``push`` (broadcast into
    the engines by push group ``epoch``) or ``shared`` (written into the
    learner's shared-memory segment ``shared`` on this machine);
    :mod:`asyncrl.weights.transports` reads it, nothing else.
    """

    version: int
    uri: str = ""
    num_bytes: int = 0
    published_s: float = 0.0
    transport: Literal["folder", "served", "push", "shared"] = "folder"
    epoch: int = 0
    shared: SharedHandle | None = None  # shared: the learner's segment on this machine
    # The learner process that announced it (its coordinator's session). A learner resumed from a checkpoint
    # numbers its versions on from the checkpoint's, so the same number may name other weights than the ones a
    # generator loaded before the restart: a version is (session, version), never the number alone.
    session: str = ""

    @property
    def identity(self) -> tuple[str, int]:
        return self.session, self.version


class PromptTicket(msgspec.Struct, frozen=True):
    """The right to generate one group of ``group_size`` samples for a prompt."""

    prompt_index: int
    group_id: str


Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class WorkRequest(_Message, tag="work_request"):
    """A generator asks for prompts. Doubles as its heartbeat."""

    generator_id: str
    weight_version: Count
    max_groups: Count  # a negative one would hand slots back to the staleness bound
    weight_session: str = ""  # WeightUpdate.session of the weights it serves ("": the model it started with)
    # Tickets it will never answer because its engine refused their prompt (too long for it): group id -> why.
    # The learner frees their slots and issues those prompts no more.
    refused: dict[str, str] = {}
    samples_generated: Count = 0
    busy_s: Seconds = 0.0
    reward_failures: dict[str, Count] = {}  # rewards that failed (rollouts sent reward_failed), by reason, since start
    wait_s: Seconds = 0.0  # with no work for it yet, the learner may hold the request this long (a long poll)
    incarnation: str = ""  # new for every process start: a generator restarted under its id is told apart
    # A drained generator's goodbye (it holds no tickets): the learner forgets it now, not after its lease.
    leaving: bool = False
    # New for every ask, the same when a timed-out ask is sent again: a reply with tickets that was lost on the
    # way is sent again rather than followed by new tickets, which would leave the lost ones out until
    # coordinator.ticket_timeout_s.
    request_id: str = ""
    # Groups written whole to a buffer that keeps them past this process's end (Redis), since its last request
    # that was answered: should this generator be lost or restart, the learner waits for those to arrive rather
    # than having them generated again.
    written: list[str] = []


class EvalTicket(msgspec.Struct, frozen=True):
    """Held-out prompts (indices into the task's eval items) to evaluate for the eval of ``version``."""

    version: int
    indices: list[int]
    k: int  # samples per prompt for pass@k, besides the greedy one
    temperature: float
    max_new_tokens: int


class WorkReply(_Message, tag="work_reply"):
    """Prompts to generate now (possibly none), the latest weights, and maybe a piece of an evaluation.

    An empty ``tickets`` list is backpressure: generating more now would
    produce samples that could not be trained on within ``max_staleness``.
    """

    tickets: list[PromptTicket]
    latest: WeightUpdate | None = None
    stop: bool = False
    retry_after_s: float = 0.0
    eval: EvalTicket | None = None
    reason: str = ""  # with stop, when it is not that the learner is done


class EvalTrace(msgspec.Struct, kw_only=True):
    """One evaluated response: what was asked, what came back, how it scored, under which weights."""

    index: int  # into the task's eval items
    prompt: str
    response: str
    answer: str | None  # the final answer the reward extracted, where it extracts one
    reward: float
    version: int
    greedy: bool
    label: str | None = None  # the item's reference answer (its ``label``), to read beside ``answer``
    reward_failed: bool = False  # the reward raised or ran out of time: scored 0, and counted


class EvalReport(_Message, tag="eval_report"):
    """A generator's results for one :class:`EvalTicket`."""

    generator_id: str
    version: int  # the eval this belongs to (the ticket's)
    indices: list[int]
    traces: list[EvalTrace]


class Ack(_Message, tag="ack"):
    """The learner took a report."""


class StatusRequest(_Message, tag="status_request"):
    """Asks a learner for a :class:`Status` snapshot."""


class GeneratorStatus(msgspec.Struct, kw_only=True):
    """What a learner knows about one generator from its heartbeats."""

    generator_id: str
    weight_version: int
    samples_generated: int
    busy_s: float
    last_seen_s: float
    reward_failures: dict[str, int] = {}
    incarnation: str = ""
    weight_session: str = ""


class Status(_Message, tag="status"):
    """A snapshot of a running learner, for ``asyncrl status``."""

    step: int
    total_steps: int
    version: int
    max_staleness: int
    samples_consumed: int
    samples_dropped: dict[str, int]
    samples_admitted: int
    buffer: dict[str, float]
    generators: list[GeneratorStatus]
    rejected: dict[str, int] = {}  # buffer entries refused, by reason
    generator_lease_s: float = 0.0  # silent this long, a generator's tickets are reissued
    reward: float | None = None
    started_s: float = 0.0
    now_s: float = 0.0
    samples_per_s: float | None = None  # trained, since the run's first batch (None before the first step)


class ErrorReply(_Message, tag="error"):
    """A server's answer to a request whose handler failed; the server keeps serving."""

    reason: str


class WeightFetch(_Message, tag="weight_fetch"):
    """Asks a weight server for one chunk of a published version (``name=""``: its file list)."""

    version: int
    name: str = ""
    offset: int = 0
    base: int = -1  # a version the client holds: the server may send the difference from it instead
    wait_s: Seconds = 0.0  # the file list may wait this long for that difference, while the server makes it


class WeightChunk(_Message, tag="weight_chunk"):
    """A chunk of one file of a published version, or its file list (``files``).

    ``error`` is set when the version is gone (pruned) or the request was bad.
    """

    version: int
    name: str = ""
    offset: int = 0
    data: bytes = b""
    files: dict[str, int] = {}
    error: str = ""


# --- between learner ranks, and from learner rank 0 to push receivers (typed, not tagged) ---


class StepOrder(msgspec.Struct):
    """What learner rank 0 tells every rank to do next (sent over the ranks' gloo group)."""

    batch: list[Rollout]
    checkpoint: bool = False
    stale_peers: list[Rollout] = []  # members of the batch's groups dropped as stale: in their group's statistics
    stop: bool = False  # stop now (SIGTERM, or no more batches): no final evaluation
    finish: bool = False  # the training budget is spent: finish as after the last step


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a pushed version: its name, dtype (torch's name without ``torch.``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"tensor {self.name}: unsupported dtype {self.dtype!r}")
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


class Manifest(msgspec.Struct, frozen=True):
    """The first message of a weight push: the version and every tensor that follows, in order."""

    version: int
    bucket_bytes: int
    tensors: list[TensorSpec]


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


class RolloutLimits(msgspec.Struct, frozen=True):
    """What a receiver accepts: the size cap (checked before decoding) and the model's vocabulary."""

    max_bytes: int
    vocab_size: int | None = None


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
