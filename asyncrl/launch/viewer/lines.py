"""What the viewer keeps of each line of a run's files of one line per rollout, decoded with msgspec.

rollouts.jsonl, consumed.jsonl and dropped.jsonl grow by a line per rollout
(rollouts.jsonl with every token's values): each is decoded into the few
fields the page shows, the rest of the line skipped unparsed, which is what
keeps a long run's folder quick to open and small in memory.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Row(msgspec.Struct):
    """A kept rollout as the rollout list shows it (its tokens only counted)."""

    id: Any = None
    step: Any = None
    version: Any = None
    group: Any = None
    prompt_index: Any = None
    reward: Any = None
    staleness: Any = None
    finish_reason: Any = None
    generator: Any = None
    drop_reason: Any = None
    response_ids: msgspec.Raw = msgspec.Raw(b"[]")


class _Trained(msgspec.Struct):
    step: Any = None
    staleness: Any = None


class _Dropped(msgspec.Struct):
    reason: Any = "?"


def _decoder(kind: type) -> Any:
    decoder = msgspec.json.Decoder(kind)

    def decode(line: bytes) -> Any:
        try:
            return decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    return decode


decode_row, decode_trained, decode_dropped = _decoder(_Row), _decoder(_Trained), _decoder(_Dropped)


def row(record: _Row, offset: int) -> dict:
    """What the rollout list shows of a kept rollout, and where its line starts (``at``)."""
    fields = {name: getattr(record, name) for name in _Row.__struct_fields__ if name != "response_ids"}
    return fields | {"tokens": _count(bytes(record.response_ids)), "at": offset}


def trained(record: _Trained, offset: int) -> tuple[Any, Any]:
    """consumed.jsonl's (step, staleness), counted for the staleness histogram over time."""
    return record.step, record.staleness


def dropped(record: _Dropped, offset: int) -> str:
    """dropped.jsonl's reason, counted for the drops by reason."""
    return str(record.reason)


def _count(array: bytes) -> int:
    """The elements of a JSON array of numbers, counted without parsing them (0 for ``[]`` or ``null``)."""
    inner = array.strip().removeprefix(b"[").removesuffix(b"]").strip()
    return 0 if not inner or inner == b"null" else inner.count(b",") + 1
