"""The headline JSON and the tables of bench/README.md, generated from the benchmark records.

    python bench/report.py            # rewrites bench/results/headline.json and the README's tables
    python bench/report.py --check    # exits 1 if either is out of date with bench/records/ (CI)

It also fills the headline block of the front README.md (``<!-- records:begin headline -->``, the few
results of ``HEADLINES``) and writes docs/benchmarks.md, the docs site's copy of bench/README.md.

Each benchmark's table sits in the README between ``<!-- records:begin BENCH -->`` and
``<!-- records:end BENCH -->``; everything outside those markers is left as written. A table has one row
per case and one column per metric, each cell the newest record of that case and metric.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, the repository root is not
    sys.path.insert(0, str(ROOT))

from bench.records import FOLDER, Record, RecordError, latest, load_folder  # noqa: E402

README = ROOT / "bench" / "README.md"
HEADLINE = ROOT / "bench" / "results" / "headline.json"
FRONT = ROOT / "README.md"
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
# The results the front README shows: (benchmark, case, metric, what it says).
HEADLINES = [
    ("peer_trl", "cpu: quickstart", "time_to_0.9_s", "CPU quickstart: seconds to a 0.9 mean reward"),
    ("peer_trl", "gpu: arith-smollm2", "time_to_0.8_s", "SmolLM2-135M story problems: seconds to a 0.8 reward"),
    ("peer_trl", "gpu: arith-smollm2", "samples_per_s", "SmolLM2-135M story problems: samples/s"),
    (
        "staleness_sweep",
        "max_staleness=2, off_policy=none",
        "samples_per_s",
        "copy-cpu, max_staleness 2 against 0: samples/s",
    ),
    (
        "learner",
        "1.5b, 32k tokens, 2 GPUs, zero3, without Liger, autograd log-prob tail",
        "tokens_per_s_per_gpu",
        "learner, 1.5B model, 32k tokens, 2 GPUs: tokens/s per GPU",
    ),
]
BLOCK = re.compile(r"<!-- records:begin (\S+) -->\n(.*?)<!-- records:end (\S+) -->", re.DOTALL)


class ReportError(Exception):
    """The README and the records do not fit together (a benchmark without its table block, or the reverse)."""


def fmt(x: float | None) -> str:
    """A number as the tables show it: thousands separated above 1,000, three significant digits below."""
    if x is None:
        return "–"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:#.3g}"


def cell(record: Record) -> str:
    """One table cell: the median, its spread and n, and the ratio to the peer."""
    if record.value is None:
        reached = sum(r is not None for r in record.repeats)
        text = f"not reached ({reached} of {record.n})"
    else:
        text = fmt(record.value)
        if record.spread is not None:  # an end that is None is a run that never got there
            low, high = (fmt(x) if x is not None else "never" for x in (record.spread.low, record.spread.high))
            text += f" [{low}–{high}, n={record.n}]"
        elif record.n > 1:
            text += f" (n={record.n})"
    if record.vs is not None:
        vs = record.vs
        if vs.ratio is not None:
            text += f"; {vs.ratio:.2f}× {vs.name} ({fmt(vs.value)})"
        elif vs.value is None and vs.repeats:
            text += f"; {vs.name} not reached ({sum(r is not None for r in vs.repeats)} of {vs.n})"
        else:
            text += f"; {vs.name} {fmt(vs.value)}"
    return text


def _distinct(values: list[str]) -> str:
    return ", ".join(dict.fromkeys(values))


def _order(records: list[Record]) -> tuple[dict[tuple[str, str], Record], list[str], list[str]]:
    """The newest record of each (case, metric), and the cases and metrics newest run first.

    A run is a stretch of consecutive records with the same commit, date and machine; within one, the order
    it appended them in. So current figures come first and superseded variants sink to the bottom."""
    run, place, previous = -1, {}, None
    for index, record in enumerate(records):
        stamp = (record.commit, record.date, record.machine)
        run += stamp != previous
        previous = stamp
        place[(record.case, record.metric)] = (-run, index)
    current = latest(records)
    cases: dict[str, tuple[int, int]] = {}
    metrics: dict[str, tuple[int, int]] = {}
    for (case, metric), key in place.items():
        cases[case] = min(cases.get(case, key), key)
        metrics[metric] = min(metrics.get(metric, key), key)
    return current, sorted(cases, key=cases.__getitem__), sorted(metrics, key=metrics.__getitem__)


def table(records: list[Record]) -> str:
    """The markdown table of one benchmark's records: a row per case and a column per metric (the other way
    round where metrics far outnumber cases), with the date, commit and machine of each case's figures."""
    current, cases, metrics = _order(records)

    def label(metric: str) -> str:
        last = next(r for (_, m), r in current.items() if m == metric)
        return f"{metric} ({last.unit}, {'↑' if last.higher_is_better else '↓'})"

    def about(case: str) -> list[str]:
        present = [r for (c, _), r in current.items() if c == case]
        return [
            _distinct([r.date[:10] for r in present]),
            _distinct([r.commit.split("+")[0][:7] + ("+dirty" if "+dirty" in r.commit else "") for r in present]),
            "; ".join(dict.fromkeys(r.machine for r in present)),
        ]

    def cells(case: str) -> list[str]:
        return [cell(current[(case, m)]) if (case, m) in current else "" for m in metrics]

    if len(metrics) > max(3, 2 * len(cases)):  # transposed, one column per case: a table that fits the page
        rows = [["metric", *cases], ["---"] * (len(cases) + 1)]
        rows += [[label(m), *(cell(current[(c, m)]) if (c, m) in current else "" for c in cases)] for m in metrics]
        details = [about(case) for case in cases]
        rows += [[name, *(d[i] for d in details)] for i, name in enumerate(("date", "commit", "machine"))]
    else:
        rows = [["case", *map(label, metrics), "date", "commit", "machine"], ["---"] * (len(metrics) + 4)]
        rows += [[case, *cells(case), *about(case)] for case in cases]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines[1] = "|" + "---|" * len(rows[0])
    return "\n".join(lines) + "\n"


def _entry(record: Record) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "value": record.value,
        "unit": record.unit,
        "higher_is_better": record.higher_is_better,
        "n": record.n,
        "spread": None if record.spread is None else [record.spread.low, record.spread.high],
    }
    if record.vs is not None:
        entry["vs"] = {"name": record.vs.name, "value": record.vs.value, "ratio": record.vs.ratio}
    entry.update(date=record.date, commit=record.commit, machine=record.machine)
    return entry


def headline(by_bench: dict[str, list[Record]]) -> dict[str, Any]:
    """The newest record of every benchmark, case and metric as one JSON object (spreads are [min, max])."""
    out: dict[str, Any] = {
        "what": "The newest record of each benchmark, case and metric; generated by `python bench/report.py` "
        "from bench/records/ (do not edit: append records instead). value is the median over n repeats.",
        "benches": {},
    }
    for bench, records in by_bench.items():
        cases: dict[str, dict[str, Any]] = {}
        for (case, metric), record in latest(records).items():
            cases.setdefault(case, {})[metric] = _entry(record)
        out["benches"][bench] = cases
    return out


def splice(readme: str, tables: dict[str, str]) -> str:
    """The README with each benchmark's block replaced by its table; every block needs records and vice versa."""
    found = []

    def replace(match: re.Match[str]) -> str:
        bench, end = match.group(1), match.group(3)
        if bench != end:
            raise ReportError(f"README block 'records:begin {bench}' is closed by 'records:end {end}'")
        if bench not in tables:
            raise ReportError(f"README has a table block for {bench!r} but bench/records/ has no {bench}.jsonl")
        found.append(bench)
        return f"<!-- records:begin {bench} -->\n{tables[bench]}<!-- records:end {bench} -->"

    text = BLOCK.sub(replace, readme)
    missing = sorted(set(tables) - set(found))
    if missing:
        raise ReportError(f"README has no table block for {', '.join(missing)}: add <!-- records:begin NAME -->")
    return text


def render(folder: Path, readme_path: Path) -> tuple[str, str]:
    """The README text and the headline JSON text that the records in ``folder`` call for."""
    by_bench = load_folder(folder)
    readme = splice(readme_path.read_text(), {bench: table(records) for bench, records in by_bench.items()})
    return readme, json.dumps(headline(by_bench), indent=1, ensure_ascii=False) + "\n"


def headline_table(folder: Path) -> str:
    """The front README's few results: each the newest record, with its peer, date and machine."""
    by_bench = load_folder(folder)
    rows = ["| result | asyncrl | peer | date | machine |", "|---|---|---|---|---|"]
    for bench, case, metric, what in HEADLINES:
        record = latest(by_bench.get(bench, [])).get((case, metric))
        if record is None:
            raise ReportError(f"headline {bench}/{case}/{metric} has no record in {folder}")
        mine = _median(record.value, record.repeats, record.n)
        peer = "–"
        if record.vs is not None:
            theirs = _median(record.vs.value, record.vs.repeats, record.vs.n)
            peer = f"{record.vs.name}: {theirs}" + (f"; ratio {record.vs.ratio:.2f}×" if record.vs.ratio else "")
        machine = record.machine.split(", ")[0]  # the hardware; software versions are in bench/README.md
        rows.append(f"| {what} | {mine} | {peer} | {record.date[:10]} | {machine} |")
    return "\n".join(rows) + "\n"


def _median(value: float | None, repeats: list[float | None], n: int) -> str:
    """A median of n repeats as the front page says it; a None median is a target most repeats never reached."""
    if value is None:
        return f"not reached ({sum(r is not None for r in repeats)} of {n} runs reached it)"
    return fmt(value) + (f" (median of {n})" if n > 1 else " (one run)")


def docs_page(bench_readme: str) -> str:
    """docs/benchmarks.md: bench/README.md as the docs site shows it."""
    title, _, rest = bench_readme.partition("\n")
    note = "<!-- generated by `python bench/report.py` from bench/README.md and bench/records/: do not edit -->"
    return f"{title}\n\n{note}\n{rest}"


def main(argv: list[str] | None = None) -> int:
    """Regenerates the README's tables and the headline JSON, or with ``--check`` only says whether they are stale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=Path, default=FOLDER, help="folder of <bench>.jsonl files")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--headline", type=Path, default=HEADLINE)
    parser.add_argument("--front", type=Path, help="README with a headline block (default: README.md)")
    parser.add_argument("--docs", type=Path, help="docs page of the tables (default: docs/benchmarks.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if either file is out of date")
    args = parser.parse_args(argv)
    if args.readme == README and args.records == FOLDER:  # the repository's own: the front page and docs too
        args.front, args.docs = args.front or FRONT, args.docs or DOCS_PAGE
    try:
        readme, headline_text = render(args.records, args.readme)
        outputs = [(args.readme, readme), (args.headline, headline_text)]
        if args.front is not None:
            front = splice(args.front.read_text(), {"headline": headline_table(args.records)})
            outputs.append((args.front, front))
        if args.docs is not None:
            outputs.append((args.docs, docs_page(readme)))
    except (RecordError, ReportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stale = [str(path) for path, text in outputs if not path.exists() or path.read_text() != text]
    if args.check:
        if stale:
            print("out of date with the records: " + ", ".join(stale) + "; run `python bench/report.py`")
            return 1
        print("README tables, headline JSON, front README and docs page are up to date with the records")
        return 0
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"wrote {', '.join(str(path) for path, _ in outputs)}" + ("" if stale else " (unchanged)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
