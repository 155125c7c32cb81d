"""Benchmark records: the format and its checks, the generated tables and headline, and every script's records."""

from __future__ import annotations

import csv
import importlib
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from bench import records, report
from bench.records import Record, RecordError, Spread, Stamp

RESULTS = ROOT / "bench" / "results"
AT = Stamp(commit="abc1234", date="2026-12-04", machine="2 CPU cores (x86_64)")


def demo(value_repeats: list[float | None], *, case: str = "tiny", metric: str = "tokens_per_s", **kw) -> Record:
    return records.measure(AT, bench="demo", case=case, metric=metric, unit="tokens/s", repeats=value_repeats, **kw)


def test_a_record_round_trips_through_its_file(tmp_path):
    path = tmp_path / "demo.jsonl"
    first = demo([3.0, 1.0, 2.0], vs=records.peer("plain", [1.0, 1.0, 1.5]), seeds=[0, 1, 2], settings={"n": 8})
    second = demo([5.0], notes="one run")
    records.append(path, first)
    records.append(path, second)
    assert records.load(path) == [first, second]
    assert path.read_text().count("\n") == 2


def test_median_and_spread_come_from_the_repeats():
    record = demo([3.0, 1.0, 2.0, 10.0], vs=records.peer("plain", [1.0, 2.0]))
    assert record.value == 2.5 and record.n == 4
    assert record.spread == Spread(low=1.0, high=10.0)
    assert record.vs.value == 1.5 and record.vs.ratio == pytest.approx(2.5 / 1.5)
    assert demo([7.0]).spread is None  # one run: no spread, none invented


def test_a_run_that_never_got_there_counts_as_the_slowest():
    time = dict(metric="time_to_0.8_s", higher_is_better=False)
    assert records.summarize([31.2, None, 38.4], higher_is_better=False) == (38.4, Spread(low=31.2, high=None))
    record = demo([27.5, None, None], **time, vs=records.peer("TRL", [10.0, 12.0, 14.0], higher_is_better=False))
    assert record.value is None and record.vs.ratio is None
    assert "not reached (1 of 3)" in report.cell(record)
    assert "38.4 [31.2–never, n=3]" in report.cell(demo([31.2, None, 38.4], **time))


@pytest.mark.parametrize(
    "change, words",
    [
        ({"value": 9.0}, "not the median"),
        ({"n": 5}, "but there are 3 repeats"),
        ({"case": "run at 3dd5c85"}, "commit hash"),
        ({"commit": "HEAD"}, "commit 'HEAD'"),
        ({"date": "yesterday"}, "ISO format"),
        ({"spread": Spread(low=0.0, high=9.0)}, "not the min-max"),
    ],
)
def test_a_malformed_record_is_refused_with_the_file_and_line(tmp_path, change, words):
    path = tmp_path / "demo.jsonl"
    good = demo([1.0, 2.0, 3.0])
    bad = records.msgspec.structs.replace(good, **change)
    path.write_bytes(records.msgspec.json.encode(good) + b"\n" + records.msgspec.json.encode(bad) + b"\n")
    with pytest.raises(RecordError, match=rf"demo\.jsonl:2: .*{words}"):
        records.load(path)
    with pytest.raises(ValueError, match=words):
        records.append(tmp_path / "other.jsonl", bad)  # nor appended


def test_a_line_that_is_not_a_record_names_its_line(tmp_path):
    path = tmp_path / "demo.jsonl"
    path.write_text(records.msgspec.json.encode(demo([1.0])).decode() + '\n\n{"bench": "demo", "case": "x"}\n')
    with pytest.raises(RecordError, match=r"demo\.jsonl:3: .*required field"):
        records.load(path)


def test_records_go_only_into_their_benchmarks_file(tmp_path):
    with pytest.raises(RecordError, match="belongs in demo.jsonl"):
        records.append(tmp_path / "other.jsonl", demo([1.0]))
    records.write("none", [demo([1.0])])  # --records none: nowhere
    assert not list(tmp_path.iterdir())


README = """# Demo

Prose the report leaves alone.

<!-- records:begin demo -->
stale
<!-- records:end demo -->

More prose.
"""


def tiny_folder(tmp_path) -> tuple:
    folder = tmp_path / "records"
    path = folder / "demo.jsonl"
    records.append_all(path, [demo([1.0, 2.0, 3.0]), demo([0.5], metric="share")])
    newer = Stamp(commit="def5678", date="2026-12-05", machine="1x NVIDIA H200")
    records.append(
        path,
        records.measure(
            newer,
            bench="demo",
            case="tiny",
            metric="tokens_per_s",
            unit="tokens/s",
            repeats=[40.0, 41.0],
            vs=records.peer("plain vLLM", [20.0, 20.5]),
        ),
    )
    readme = tmp_path / "README.md"
    readme.write_text(README)
    return folder, readme, tmp_path / "headline.json"


def generate(folder, readme, headline, *extra: str) -> int:
    return report.main(["--records", str(folder), "--readme", str(readme), "--headline", str(headline), *extra])


def test_the_report_writes_the_newest_record_of_each_case_and_metric(tmp_path):
    folder, readme, headline = tiny_folder(tmp_path)
    assert generate(folder, readme, headline) == 0
    text = readme.read_text()
    assert text.startswith("# Demo\n\nProse the report leaves alone.") and text.endswith("More prose.\n")
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 1
    assert "40.5 [40.0–41.0, n=2]; 2.00× plain vLLM (20.2)" in rows[0]  # the newer run, not the median of 1-3
    assert "| 0.500 |" in rows[0] and "def5678, abc1234" in rows[0]  # share: still the older run's
    entry = json.loads(headline.read_text())["benches"]["demo"]["tiny"]["tokens_per_s"]
    assert entry["value"] == 40.5 and entry["spread"] == [40.0, 41.0] and entry["n"] == 2
    assert entry["vs"]["ratio"] == pytest.approx(40.5 / 20.25) and entry["commit"] == "def5678"


def test_the_report_fills_the_front_page_headline_and_the_docs_page(tmp_path):
    """--front gets the few HEADLINES results with date and machine; --docs a copy of the tables' page."""
    readme = tmp_path / "bench-README.md"
    readme.write_text((ROOT / "bench" / "README.md").read_text())
    front = tmp_path / "README.md"
    front.write_text("# Front\n\n<!-- records:begin headline -->\nstale\n<!-- records:end headline -->\n")
    paths = ["--readme", str(readme), "--headline", str(tmp_path / "h.json")]
    paths += ["--front", str(front), "--docs", str(tmp_path / "benchmarks.md")]
    assert report.main(paths) == 0
    rows = [line for line in front.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(report.HEADLINES) and "\nstale\n" not in front.read_text()
    assert all(row.count("|") == 6 and "2026-" in row for row in rows)
    assert re.search(r"\| TRL: [0-9.]+ \(median of 3\); ratio [0-9.]+× \|", rows[0]), rows[0]
    docs = (tmp_path / "benchmarks.md").read_text()
    assert docs.startswith("# Benchmarks\n\n<!-- generated by") and "records:begin peer_trl" in docs
    assert report.main([*paths, "--check"]) == 0


def test_check_finds_a_readme_older_than_the_records(tmp_path, capsys):
    folder, readme, headline = tiny_folder(tmp_path)
    assert generate(folder, readme, headline, "--check") == 1  # the README still says "stale"
    assert generate(folder, readme, headline) == 0
    assert generate(folder, readme, headline, "--check") == 0
    records.append(folder / "demo.jsonl", demo([99.0]))
    assert generate(folder, readme, headline, "--check") == 1
    assert "out of date" in capsys.readouterr().out
    assert "99.0" not in readme.read_text()  # --check writes nothing


def test_a_benchmark_without_its_table_block_is_an_error(tmp_path, capsys):
    folder, readme, headline = tiny_folder(tmp_path)
    readme.write_text("# Demo\n")
    assert generate(folder, readme, headline) == 2
    assert "no table block for demo" in capsys.readouterr().err


def test_the_committed_tables_and_headline_are_up_to_date_with_the_committed_records():
    assert report.main(["--check"]) == 0


def test_no_committed_record_keeps_history_in_a_name():
    for bench, found in records.load_folder().items():
        assert found, bench
        for record in found:  # load validated each: names without commit hashes, medians, spreads, ratios
            assert record.bench == bench


def fake_e2e() -> dict:
    """One workload's figures as bench/e2e.py reports them, without running anything."""
    side = {"max_staleness": 2, "generator_capacity_samples_per_s": 20.0, "learner_capacity_samples_per_s": 90.0}
    workload = {
        "pipeline_efficiency": 1.03,
        "async_over_sync": 1.17,
        "async_over_sync_tokens": 1.17,
        "async_over_sync_bound": 1.21,
        "async_samples_per_s": 19.4,
        "sync_samples_per_s": 16.6,
        "async": side,
        "sync": side,
    }
    return {
        "gpus": 1,
        "steps": 30,
        "max_new_tokens": 1024,
        "settings": ["learner.lr=1e-6"],
        "workloads": {"w": workload},
    }


def committed(name: str):
    return lambda: json.loads((RESULTS / name).read_text())


SCRIPTS = [
    ("buffer_bench", committed("buffer_bench.json"), ()),
    ("delta_bench", committed("delta_bench.json"), ()),
    ("detokenize_bench", committed("detokenize_cpu.json"), ()),
    ("e2e", fake_e2e, ()),
    ("generator_bench", committed("generator_bench.json"), ()),
    ("generator_vs_vllm", committed("generator_vs_vllm.json"), ()),
    ("handover_bench", committed("handover_cpu.json"), ()),
    ("layout_bench", committed("layout_cpu_busy.json"), ()),
    ("learner_step", committed("learner_step_cpu.json"), ()),
    ("learner_report", lambda: json.loads((RESULTS / "learner_1gpu.json").read_text())["runs"], ()),
    ("learning_run", committed("arith_smollm2_h200/run.json"), ("arith-smollm2",)),
    ("logprob_tail_bench", committed("logprob_tail_cpu.json"), ()),
    ("packing_bench", committed("packing_gpu.json"), ()),
    ("peer_trl", committed("peer_trl_gpu.json"), ()),
    ("prefix_cache_bench", committed("prefix_cache_bench.json"), ()),
    ("publish_bench", committed("publish_bench.json"), ()),
    ("push_bench", committed("push_bench.json"), ()),
    ("push_pipeline", committed("push_pipeline_cpu.json"), ()),
    ("scaling_run", committed("scaling_2gpu.json"), ()),
    ("update_parity", committed("update_parity_h200.json"), ()),
    ("version_watch_bench", committed("version_watch_cpu.json"), ()),
]


@pytest.mark.parametrize("module, result, extra", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_each_script_turns_its_result_into_valid_records(module, result, extra, tmp_path):
    found = importlib.import_module(f"bench.{module}").records_of(result(), AT, *extra)
    assert found
    bench = found[0].bench
    assert {r.bench for r in found} == {bench}
    assert records.append_all(tmp_path / f"{bench}.jsonl", found) == len(found)  # validated
    assert records.load(tmp_path / f"{bench}.jsonl") == found
    if module == "e2e":  # --set overrides name their own case: they never stand for the defaults
        assert {r.case for r in found} == {"w [learner.lr=1e-6]"}
        assert next(r for r in found if r.metric == "samples_per_s").vs.ratio == pytest.approx(19.4 / 16.6)


def test_each_packing_mode_stands_beside_its_run_with_log_probs_at_every_position():
    """--every-position: a mode's record is measured against the same mode with the prompts' log-probs computed
    too, and the case names the lengths, which decide what that saves."""
    from bench import packing_bench

    found = packing_bench.records_of(committed("packing_response_positions_cpu.json")(), AT)
    by_metric = {r.metric: r for r in found}
    assert {r.case for r in found} == {"SmolLM2-135M shape, 32 rollouts (prompts 58, responses up to 32)"}
    padded = by_metric["padded_tokens_per_s"]
    assert padded.vs.name == "log-probs at every position"
    assert padded.vs.value == by_metric["padded_every_position_tokens_per_s"].value and padded.vs.ratio > 1
    assert by_metric["padded_every_position_tokens_per_s"].vs is None


def test_a_learning_run_without_evaluation_keeps_its_pipeline_figures_and_no_pass_at_1():
    """An evaluation-off run beside an evaluation-on one prices the evaluation: both keep samples/s and the
    pipeline's efficiency, and the run that evaluated nothing claims no pass@1."""
    from bench import learning_run

    run = {"steps": 700, "training_wall_s": 180.0, "pass@1_final": None, "pass@1_start": None}
    run |= learning_run.pipeline({"achieved_samples_per_s": 533.25, "pipeline_efficiency": 0.861, "wall_s": 180})
    found = {r.metric: r for r in learning_run.records_of(run, AT, "arith-smollm2 [--eval.every_steps=0]")}
    assert set(found) == {"samples_per_s", "pipeline_efficiency"}
    assert found["pipeline_efficiency"].value == 0.861 and found["samples_per_s"].unit == "samples/s"


def test_a_learning_run_prices_evaluation_in_trained_tokens_and_keeps_its_share(tmp_path):
    """Two runs whose answers settled at different lengths trained different work per sample: tokens/s is the
    rate to compare, read from the run's steps (their response tokens) over its training seconds."""
    from bench import learning_run

    steps = [{"tokens": 80 * 128, "samples": 128}, {"tokens": 20 * 128, "samples": 128}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(step) + "\n" for step in steps))
    summary = {"wall_s": 4.0, "eval": {"token_share": 0.10484}}
    measured = learning_run.trained_tokens(tmp_path, summary)
    assert measured == {"response_tokens_per_s": 128 * 100 / 4.0, "eval_token_share": 0.1048}
    run = {"steps": 2, "training_wall_s": 4.0, "pass@1_final": None} | measured
    found = {r.metric: r for r in learning_run.records_of(run, AT, "arith-smollm2")}
    assert found["response_tokens_per_s"].unit == "tokens/s" and found["response_tokens_per_s"].higher_is_better
    assert found["eval_token_share"].value == 0.1048 and not found["eval_token_share"].higher_is_better


def test_a_sweep_folder_becomes_records_beside_its_sync_cells():
    folder = RESULTS / "staleness_sweep_cpu"
    with (folder / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    sweep = json.loads((folder / "sweep.json").read_text())
    from bench import sweep_records

    found = sweep_records.records_of(sweep, rows, AT, "staleness_sweep")
    time = {r.case: r for r in found if r.metric == "time_to_target_s"}
    assert time["max_staleness=0, off_policy=none"].vs is None
    assert time["max_staleness=2, off_policy=none"].vs.value == time["max_staleness=0, off_policy=none"].value
    assert time["max_staleness=2, off_policy=none"].seeds == [0, 1]


def test_learner_report_appends_records_where_records_says(tmp_path):
    runs = tmp_path / "runs.jsonl"
    shape = dict(model="0.5b", seq=4096, batch_per_gpu=4, gpus=1, checkpointing=True, accumulate=1, logprobs="fused")
    lines = [
        dict(impl="fsdp2", liger=False, tokens_per_s_per_gpu=40000.0, mfu=0.15, peak_mem_gb=9.9, **shape),
        dict(impl="asyncrl", liger=True, tokens_per_s_per_gpu=48000.0, mfu=0.18, peak_mem_gb=10.5, **shape),
    ]
    runs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out, where = tmp_path / "learner.json", tmp_path / "learner.jsonl"
    command = [sys.executable, "bench/learner_report.py", str(runs), "--out", str(out), "--commit", "abc1234"]
    command += ["--machine", "1x NVIDIA H200", "--records", str(where)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = [r for r in records.load(where) if r.metric == "tokens_per_s_per_gpu"]
    assert [(r.case, r.value, r.vs.ratio, r.commit) for r in tokens] == [
        ("0.5b, 4k tokens, 1 GPU", 48000.0, 1.2, "abc1234")
    ]
    assert json.loads(out.read_text())["pairs"][0]["over_fsdp2"] == 1.2


def test_a_side_run_in_several_passes_is_judged_on_all_its_rounds():
    """generator_vs_vllm --passes: the sides take turns; each side's best and median cover every pass's rounds."""
    from bench.generator_vs_vllm import pool

    first = {"tokens_per_s": [10.0, 12.0, 11.0], "best": 12.0, "median": 11.0, "kv_cache_tokens": 5}
    second = {"tokens_per_s": [14.0, 13.0, 15.0], "best": 15.0, "median": 14.0, "kv_cache_tokens": 6}
    both = pool(pool(None, first), second)
    assert both["tokens_per_s"] == [10.0, 12.0, 11.0, 14.0, 13.0, 15.0]
    assert (both["best"], both["median"], both["pass_medians"]) == (15.0, 12.5, [11.0, 14.0])
    assert both["kv_cache_tokens"] == 6
