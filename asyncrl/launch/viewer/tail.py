"""JSONL files a run appends to, read as they grow: what ``asyncrl view`` keeps of each line, parsed once.

A run appends to its JSONL files and, resumed from a checkpoint, cuts them back
to the checkpoint's step in place (the same file, rewritten). Each read parses
only the bytes added since the last one, a block at a time (memory stays
bounded however much was added); a file replaced, cut shorter, or rewritten
under the bytes already parsed (the few before the last offset no longer
match) is read again from its start.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

GUARD_BYTES = 64  # the bytes before the offset re-read each time, to notice a file rewritten under it
BLOCK_BYTES = 8 * 2**20  # read at a time


def parse(line: str | bytes) -> dict | None:
    """One JSONL line's record; None for a line that is not a JSON object."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def read_at(path: Path, offset: int) -> dict | None:
    """The record of the line that starts at byte ``offset`` of ``path`` (None if it is gone or not one)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return parse(f.readline())
    except OSError:
        return None


def find_line(path: Path, needle: bytes, accept: Callable[[dict], bool]) -> dict | None:
    """The first record of ``path`` whose line holds ``needle`` and that ``accept`` takes: the file searched a
    block at a time, only the lines holding the needle parsed."""
    try:
        with path.open("rb") as f:
            carry = b""
            while block := f.read(BLOCK_BYTES):
                block, carry = _whole(carry + block)
                start = block.find(needle)
                while start >= 0:
                    begin, end = block.rfind(b"\n", 0, start) + 1, block.find(b"\n", start)
                    record = parse(block[begin:end])
                    if record is not None and accept(record):
                        return record
                    start = block.find(needle, end)
            record = parse(carry) if needle in carry else None
            return record if record is not None and accept(record) else None
    except OSError:
        return None


def _whole(data: bytes) -> tuple[bytes, bytes]:
    """``data`` split after its last newline: its whole lines, and the rest."""
    cut = data.rfind(b"\n") + 1
    return data[:cut], data[cut:]


class Tail:
    """What is kept of each line of one JSONL file, up to its last whole line.

    ``decode(line)`` parses a line's bytes (None: not a record; by default :func:`parse`), ``keep(record,
    offset)`` says what to keep of a record (None: nothing), ``offset`` being where its line starts in the
    file; by default the whole record. With ``tally``, the kept values are counted (a
    :class:`~collections.Counter`) rather than listed: for files of one line per rollout.
    """

    def __init__(
        self,
        keep: Callable[[Any, int], Any] | None = None,
        tally: bool = False,
        decode: Callable[[bytes], Any] = parse,
    ) -> None:
        self.keep = keep or (lambda record, offset: record)
        self.tally, self.decode = tally, decode
        self._restart(None)

    def _restart(self, identity: tuple[int, int] | None) -> None:
        self.identity = identity  # (device, inode) of the file parsed so far
        self.offset = 0  # bytes parsed, up to the end of the last whole line
        self.guard = b""  # the bytes just before the offset, as they were read
        self.kept: list[Any] | Counter[Hashable] = Counter() if self.tally else []
        self.bad = 0

    def read(self, path: Path) -> tuple[list[Any] | Counter[Hashable], int]:
        """What is kept of every line so far (a line still being written included, when it decodes) and how
        many lines did not."""
        torn = b""
        try:
            with path.open("rb") as f:
                self._check(f)
                while block := f.read(BLOCK_BYTES):
                    lines, torn = _whole(torn + block)
                    self._take(lines)
        except FileNotFoundError:
            self._restart(None)
            return self.kept.copy(), 0
        kept, bad = self.kept.copy(), self.bad
        if torn.strip():  # a line still being written: shown once it decodes, counted until then
            bad += not self._line(torn, self.offset, kept)
        return kept, bad

    def _line(self, line: bytes, at: int, kept: list[Any] | Counter[Hashable]) -> bool:
        """Add what is kept of one line (starting at byte ``at``) to ``kept``; False if it does not decode."""
        record = self.decode(line)
        if record is None:
            return False
        item = self.keep(record, at)
        if isinstance(kept, Counter) and item is not None:
            kept[item] += 1
        elif item is not None:
            kept.append(item)
        return True

    def _check(self, f) -> None:
        """Start again if the open file is not the one parsed so far, or no longer holds what was parsed."""
        stat = os.fstat(f.fileno())
        if (stat.st_dev, stat.st_ino) != self.identity or stat.st_size < self.offset:
            self._restart((stat.st_dev, stat.st_ino))
        elif self.guard:
            f.seek(self.offset - len(self.guard))
            if f.read(len(self.guard)) != self.guard:
                self._restart(self.identity)
        f.seek(self.offset)

    def _take(self, lines: bytes) -> None:
        """Parse whole ``lines`` read at the offset, and move the offset past them."""
        if not lines:
            return
        at = self.offset
        for line in lines.splitlines(keepends=True):
            if line.strip():
                self.bad += not self._line(line, at, self.kept)
            at += len(line)
        self.guard = (self.guard + lines[-GUARD_BYTES:])[-GUARD_BYTES:]
        self.offset = at
