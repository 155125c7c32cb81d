"""What every tagged wire message shares: the schema version, the base class, and the error receivers count.

The message modules (:mod:`~asyncrl.wire.rollouts`, :mod:`~asyncrl.wire.control`,
:mod:`~asyncrl.wire.weights`) build on it; import their types from
:mod:`asyncrl.wire.protocol`, which also encodes and decodes them.
"""

from __future__ import annotations

from typing import Annotated

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


class TaggedMessage(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """The base of every message :func:`asyncrl.wire.protocol.decode` accepts: tagged by type, stamped with
    ``SCHEMA_VERSION``."""

    schema: int = SCHEMA_VERSION


Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
