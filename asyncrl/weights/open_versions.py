"""The files of the last few versions a weight server served, kept open so that pruning cannot cut a fetch short.

A generator on a slow link fetches a version chunk by chunk; the learner
meanwhile publishes more and prunes the oldest (``learner.keep_versions``).
Reading each chunk by name would fail once the folder is gone, and a
generator whose whole fetch takes longer than a few versions would never
finish one. A file opened when its version's file list was asked for stays
readable after it is unlinked, until the handle is closed: the last
:data:`OPEN_VERSIONS` versions asked for keep theirs (their disk space,
pruned or not, comes back as they are closed).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

OPEN_VERSIONS = 4


class OpenVersions:
    """Open file descriptors of the versions served last, by version and file name; thread-safe."""

    def __init__(self, keep: int = OPEN_VERSIONS) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._files: OrderedDict[int, dict[str, int]] = OrderedDict()

    def open(self, version: int, folder: Path) -> dict[str, int]:
        """``folder``'s files (name -> size), opened now unless they are open already; the oldest version
        beyond :attr:`keep` is closed. FileNotFoundError if the folder went meanwhile."""
        with self._lock:
            held = self._files.get(version)
            if held is not None:
                self._files.move_to_end(version)
                return {name: os.fstat(fd).st_size for name, fd in held.items()}
        opened: dict[str, int] = {}
        try:
            for path in folder.iterdir():
                if path.is_file():
                    opened[path.name] = os.open(path, os.O_RDONLY)
        except OSError:
            _close(opened)
            raise
        with self._lock:
            if version in self._files:  # opened by another thread meanwhile
                _close(opened)
                opened = self._files[version]
            else:
                self._files[version] = opened
            while len(self._files) > self.keep:
                _close(self._files.popitem(last=False)[1])
            return {name: os.fstat(fd).st_size for name, fd in opened.items()}

    def read(self, version: int, name: str, offset: int, size: int) -> bytes | None:
        """``size`` bytes of an open file from ``offset``; None if the version's files are not open."""
        with self._lock:
            fd = self._files.get(version, {}).get(name)
            if fd is None:
                return None
            return os.pread(fd, size, offset)

    def close(self) -> None:
        with self._lock:
            while self._files:
                _close(self._files.popitem()[1])


def _close(files: dict[str, int]) -> None:
    for fd in files.values():
        os.close(fd)
