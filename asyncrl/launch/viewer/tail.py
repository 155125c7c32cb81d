"""JSONL files a run appends to, read as they grow: what ``asyncrl view`` keeps of each line, parsed once.

A run appends to its JSONL files and, resumed from a checkpoint, cuts them back
to the checkpoint's step in place (the same file, rewritten). Each read parses
only the bytes added since the last one; a file replaced, cut shorter, or
rewritten under the bytes already parsed (the few before the last offset no
longer match) is read again from its start.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

GUARD_BYTES = 64  # the bytes before the offset re-read each time, to notice a file rewritten under it


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


class Tail:
    """What is kept of each line of one JSONL file, up to its last whole line.

    ``keep(record, offset)`` says what to keep of a record (None: nothing), ``offset`` being where its line
    starts in the file; by default the whole record. With ``tally``, the kept values are counted (a
    :class:`~collections.Counter`) rather than listed: for files of one line per rollout.
    """

    def __init__(self, keep: Callable[[dict, int], Any] | None = None, tally: bool = False) -> None:
        self.keep = keep or (lambda record, offset: record)
        self.tally = tally
        self._restart(None)

    def _restart(self, identity: tuple[int, int] | None) -> None:
        self.identity = identity  # (device, inode) of the file parsed so far
        self.offset = 0  # bytes parsed, up to the end of the last whole line
        self.guard = b""  # the bytes just before the offset, as they were read
        self.kept: list[Any] | Counter[Hashable] = Counter() if self.tally else []
        self.bad = 0

    def read(self, path: Path) -> tuple[list[Any] | Counter[Hashable], int]:
        """What is kept of every line so far (a line still being written included, when it parses) and how many
        lines did not parse."""
        try:
            with path.open("rb") as f:
                self._check(f)
                added = f.read()
        except FileNotFoundError:
            self._restart(None)
            return self.kept.copy(), 0
        whole, _, torn = added.rpartition(b"\n")
        if whole or added.startswith(b"\n"):
            self._take(whole + b"\n")
        kept, bad = self.kept.copy(), self.bad
        if torn.strip():  # a line still being written: shown once it parses, counted until then
            record = parse(torn)
            item = None if record is None else self.keep(record, self.offset)
            if record is None:
                bad += 1
            elif item is not None:
                _add(kept, item)
        return kept, bad

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
        at = self.offset
        for line in lines.splitlines(keepends=True):
            if line.strip():
                record = parse(line)
                item = None if record is None else self.keep(record, at)
                if record is None:
                    self.bad += 1
                elif item is not None:
                    _add(self.kept, item)
            at += len(line)
        self.guard = (self.guard + lines)[-GUARD_BYTES:]
        self.offset = at


def _add(kept: list[Any] | Counter[Hashable], item: Any) -> None:
    if isinstance(kept, Counter):
        kept[item] += 1
    else:
        kept.append(item)
