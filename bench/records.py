"""Benchmark records: one JSON line per measurement, appended to ``bench/records/<bench>.jsonl``.

A record is one metric of one case of one benchmark, measured at one commit on one machine: the raw
values of its repeats, their median (``value``) and their spread (min and max), the settings and seeds
it ran with and, for a side-by-side comparison, the peer's value and the ratio. Files are append-only:
the newest record of a (case, metric) is the current figure, the older ones are its history.
``python bench/report.py`` turns them into ``bench/results/headline.json`` and the tables of
``bench/README.md``.

A repeat may be ``null``: the run never produced the value (say, it never reached a reward target).
It counts as the worst outcome, so the median of ``[31.2, null, 38.4]`` is 38.4, and of
``[27.5, null, null]`` it is ``null`` (the median run did not get there).
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "bench" / "records"

_BENCH = re.compile(r"^[a-z0-9_]+$")
_METRIC = re.compile(r"^[A-Za-z0-9_.@-]+$")
_COMMIT = re.compile(r"^(unknown|[0-9a-f]{7,40}(\+dirty)?)$")
# Looks like an abbreviated commit: 7-40 hex characters with at least one digit and one letter.
_HASHLIKE = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


class RecordError(ValueError):
    """A record that breaks the format, named by file and line where it was read from one."""


class Stamp(msgspec.Struct, frozen=True):
    """Where a measurement was made: the commit measured, the date (ISO) and a short machine description."""

    commit: str
    date: str
    machine: str


class Spread(msgspec.Struct, frozen=True):
    """How far the repeats spread: the lowest and highest (``null``: a run that never produced the value)."""

    low: float | None
    high: float | None
    kind: str = "min-max"


class Peer(msgspec.Struct, kw_only=True):
    """The system a record is measured against side by side (same metric, same run): its median and repeats.

    ``ratio`` is the record's value over the peer's (``null`` where either is missing); whether above 1 is
    good follows the record's ``higher_is_better``.
    """

    name: str
    value: float | None
    repeats: list[float | None] = []
    n: int = 1
    ratio: float | None = None


class Record(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One measurement: a metric of one case of one benchmark, with its repeats, provenance and settings.

    ``repeats`` is empty only for figures migrated from a summary whose raw values were not kept; ``n``
    then says how many runs the summary's value stood for.
    """

    bench: str
    case: str
    metric: str
    value: float | None
    unit: str
    higher_is_better: bool
    n: int
    repeats: list[float | None]
    spread: Spread | None = None
    vs: Peer | None = None
    seeds: list[int] = []
    settings: dict[str, Any] = {}
    commit: str
    date: str
    machine: str
    notes: str = ""


def summarize(repeats: Sequence[float | None], higher_is_better: bool) -> tuple[float | None, Spread | None]:
    """The median and min-max spread of some repeats, a missing one (``None``) counting as the worst outcome."""
    worst = -math.inf if higher_is_better else math.inf
    values = [worst if r is None else float(r) for r in repeats]
    if not values:
        raise ValueError("no repeats to summarize")
    middle = statistics.median(values)
    value = None if math.isinf(middle) else middle
    if len(values) < 2:
        return value, None
    low, high = min(values), max(values)
    return value, Spread(low=None if math.isinf(low) else low, high=None if math.isinf(high) else high)


def peer(name: str, repeats: Sequence[float | None], higher_is_better: bool = True) -> Peer:
    """The peer side of a comparison, from its repeats (``measure`` fills in the ratio)."""
    value, _ = summarize(repeats, higher_is_better)
    return Peer(name=name, value=value, repeats=list(repeats), n=len(repeats))


def _ratio(value: float | None, other: float | None) -> float | None:
    return None if value is None or other is None or other == 0 else value / other


def measure(
    stamp: Stamp,
    *,
    bench: str,
    case: str,
    metric: str,
    unit: str,
    repeats: Sequence[float | None],
    higher_is_better: bool = True,
    vs: Peer | None = None,
    seeds: Iterable[int] = (),
    settings: dict[str, Any] | None = None,
    notes: str = "",
) -> Record:
    """A validated record from raw repeats: median, spread, n and the ratio to ``vs`` computed here."""
    value, spread = summarize(repeats, higher_is_better)
    if vs is not None:
        vs = msgspec.structs.replace(vs, ratio=_ratio(value, vs.value))
    record = Record(
        bench=bench,
        case=case,
        metric=metric,
        value=value,
        unit=unit,
        higher_is_better=higher_is_better,
        n=len(repeats),
        repeats=[None if r is None else float(r) for r in repeats],
        spread=spread,
        vs=vs,
        seeds=list(seeds),
        settings=settings or {},
        commit=stamp.commit,
        date=stamp.date,
        machine=stamp.machine,
        notes=notes,
    )
    validate(record)
    return record


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _check_summary(what: str, value: float | None, repeats: list, n: int, higher_is_better: bool) -> Spread | None:
    """Checks ``value`` and ``n`` against ``repeats``; returns the spread they imply (None without repeats)."""
    if n < 1:
        raise ValueError(f"{what}: n is {n}, expected at least 1")
    if not repeats:
        return None
    if n != len(repeats):
        raise ValueError(f"{what}: n is {n} but there are {len(repeats)} repeats")
    median, spread = summarize(repeats, higher_is_better)
    if not _close(value, median):
        raise ValueError(f"{what}: value {value} is not the median of its repeats ({median})")
    return spread


def validate(record: Record) -> None:
    """Raises ``ValueError`` naming the first thing wrong with a record (names, provenance, median, spread, ratio)."""
    if not _BENCH.match(record.bench):
        raise ValueError(f"bench {record.bench!r}: expected lower-case letters, digits and _")
    if not _METRIC.match(record.metric):
        raise ValueError(f"metric {record.metric!r}: expected letters, digits and _.@-")
    if not record.case.strip() or "\n" in record.case or "|" in record.case:
        raise ValueError(f"case {record.case!r}: expected one non-empty line without '|'")
    for name in (record.case, record.metric):
        if _HASHLIKE.search(name):
            raise ValueError(f"{name!r} holds what looks like a commit hash: commits go in the commit field")
    if not _COMMIT.match(record.commit):
        raise ValueError(f"commit {record.commit!r}: expected 7-40 hex digits (optionally +dirty) or 'unknown'")
    try:
        datetime.datetime.fromisoformat(record.date)
    except ValueError:
        raise ValueError(f"date {record.date!r}: expected ISO format, e.g. 2026-12-03") from None
    if not record.machine.strip() or not record.unit.strip():
        raise ValueError("machine and unit must not be empty")
    spread = _check_summary("value", record.value, record.repeats, record.n, record.higher_is_better)
    if record.repeats and record.spread != spread:
        raise ValueError(f"spread {record.spread} is not the min-max of the repeats ({spread})")
    if record.spread is not None and record.spread.kind != "min-max":
        raise ValueError(f"spread kind {record.spread.kind!r}: only 'min-max' is used")
    if record.vs is not None:
        vs = record.vs
        _check_summary(f"vs {vs.name}", vs.value, vs.repeats, vs.n, record.higher_is_better)
        if not _close(vs.ratio, _ratio(record.value, vs.value)):
            raise ValueError(f"vs {vs.name}: ratio {vs.ratio} is not value / peer value")


_decoder = msgspec.json.Decoder(Record)
_encoder = msgspec.json.Encoder()


def load(path: Path) -> list[Record]:
    """Every record of one file, in the order appended; a bad line raises ``RecordError`` naming file and line."""
    path = Path(path)
    records = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = _decoder.decode(line)
            validate(record)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise RecordError(f"{path}:{number}: {exc}") from None
        if record.bench != path.stem:
            raise RecordError(f"{path}:{number}: bench {record.bench!r} in the file of {path.stem!r}")
        records.append(record)
    return records


def load_folder(folder: Path = FOLDER) -> dict[str, list[Record]]:
    """The records of every ``*.jsonl`` file in a folder, by benchmark (the file's stem), files sorted by name."""
    return {path.stem: load(path) for path in sorted(Path(folder).glob("*.jsonl"))}


def append(path: Path, record: Record) -> None:
    """Validates a record and appends it as one line to its benchmark's file (named ``<bench>.jsonl``)."""
    append_all(path, [record])


def append_all(path: Path, records: Iterable[Record]) -> int:
    """Validates records and appends them to one benchmark's file, all or none; returns how many."""
    path = Path(path)
    records = list(records)
    for record in records:
        validate(record)
        if record.bench != path.stem:
            raise RecordError(f"{path}: a record of bench {record.bench!r} belongs in {record.bench}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    # A file whose last line lacks its newline (an interrupted write) would glue the next record onto it.
    needs_newline = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("ab") as f:
        if needs_newline:
            f.write(b"\n")
        for record in records:
            f.write(_encoder.encode(record) + b"\n")
    return len(records)


def latest(records: Iterable[Record]) -> dict[tuple[str, str], Record]:
    """The newest record of each (case, metric), in the order the pairs first appear: append order is time order."""
    found: dict[tuple[str, str], Record] = {}
    for record in records:
        found[(record.case, record.metric)] = record  # a dict keeps a key where it was first inserted
    return found


def add_argument(parser: argparse.ArgumentParser, bench: str) -> None:
    """Adds ``--records PATH`` to a benchmark's command line: where its records go (``none``: nowhere)."""
    parser.add_argument(
        "--records",
        default=str(FOLDER / f"{bench}.jsonl"),
        help=f"append this run's records here (default: bench/records/{bench}.jsonl; 'none': do not record)",
    )


def write(destination: str | Path, records: Sequence[Record]) -> None:
    """Appends a run's records where ``--records`` says and prints what to run next (``none``: skips)."""
    if str(destination) == "none":
        return
    count = append_all(Path(destination), records)
    print(f"appended {count} records to {destination}; `python bench/report.py` updates the tables", flush=True)
