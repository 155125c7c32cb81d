"""The run timeline (``--trace``): per-process files, merging, and a real run's spans."""

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from conftest import ROOT

from asyncrl.observe import trace
from asyncrl.observe.metrics import read_metrics


def test_spans_counters_and_threads_land_in_a_file_that_reads_back_unclosed(tmp_path, monkeypatch):
    tracer = trace.Tracer(tmp_path / "trace" / "p.json", "learner rank 0")
    clock = iter([5_000_000, 8_000_000])  # the span's start and end, in nanoseconds
    with monkeypatch.context() as patch:
        patch.setattr(trace, "time", SimpleNamespace(time_ns=lambda: next(clock)))
        with tracer.span("forward", rows=4):
            pass
    tracer.counter("queue", waiting=3)
    worker = threading.Thread(target=lambda: tracer.complete("answer", 1_000_000, 3_000_000), name="server")
    worker.start()
    worker.join()
    tracer._file.flush()  # not closed: a killed process leaves the file like this
    events = trace.read_events(tmp_path / "trace" / "p.json")
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["forward"]["args"] == {"rows": 4}
    assert spans["forward"]["ts"] == 5000 and spans["forward"]["dur"] == 3000  # microseconds
    assert spans["answer"]["ts"] == 1000 and spans["answer"]["dur"] == 2000  # microseconds
    assert spans["answer"]["tid"] != spans["forward"]["tid"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"learner rank 0", "server", threading.current_thread().name} <= names
    assert [e["args"] for e in events if e["ph"] == "C"] == [{"waiting": 3}]


def test_spans_reach_the_file_within_a_second_so_a_killed_process_leaves_them(tmp_path):
    tracer = trace.Tracer(tmp_path / "p.json", "generator")
    tracer.complete("early", 1_000_000, 2_000_000)
    assert "early" not in (tmp_path / "p.json").read_text()  # buffered: a span costs no write of its own
    tracer._flushed_at -= trace.FLUSH_EVERY_S  # a second later
    tracer.complete("late", 3_000_000, 4_000_000)
    assert [e["name"] for e in trace.read_events(tmp_path / "p.json") if e["ph"] == "X"] == ["early", "late"]


def test_a_line_cut_short_is_skipped_and_merge_joins_every_process(tmp_path):
    for name in ("a", "b"):
        tracer = trace.Tracer(tmp_path / "trace" / f"{name}.json", name)
        with tracer.span(f"work-{name}"):
            pass
        tracer.close()
    with open(tmp_path / "trace" / "b.json", "a") as f:
        f.write('{"name": "cut sh')  # the process died mid-write
    merged = json.loads(trace.merge(tmp_path).read_text())
    assert sorted(e["name"] for e in merged["traceEvents"] if e["ph"] == "X") == ["work-a", "work-b"]
    assert trace.merge(tmp_path / "nothing-here") is None


def test_a_restarted_process_appends_to_the_timeline_of_the_one_before(tmp_path):
    """A generator Ray restarts under its id, or a resumed learner, writes the same file: the first life stays."""
    path = tmp_path / "trace" / "generator-0.json"
    first = trace.Tracer(path, "generator-0")
    with first.span("before the crash"):
        pass
    first.close()
    with open(path, "a") as f:
        f.write('{"name": "cut sh')  # killed mid-write
    second = trace.Tracer(path, "generator-0")
    with second.span("after the restart"):
        pass
    second.close()
    names = [e["name"] for e in trace.read_events(path) if e["ph"] == "X"]
    assert names == ["before the crash", "after the restart"]


def test_tracing_off_costs_a_shared_no_op():
    assert not trace.enabled()
    assert trace.span("x") is trace.span("y")
    trace.complete("x", 0, 1)  # nothing to write to, nothing raised


def test_a_traced_run_in_an_old_folder_shows_every_process_and_splits_the_learner_wait(tmp_path):
    steps = 20
    # An earlier run's versions in the same folder: a fresh run discards them rather than pruning its own.
    (tmp_path / "weights" / "v000999").mkdir(parents=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "run",
            str(ROOT / "configs/ci-tiny.yaml"),
            "--run-dir",
            str(tmp_path),
            "--free-ports",
            "--trace",
            "--timeout-s",
            "300",
            f"--learner.total_steps={steps}",
            "--generator.backend=transformers",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{tmp_path}/trace.json" in out.stdout
    assert "learner rank 0" in out.stdout and "generator gen-0" in out.stdout  # the summary table
    assert not (tmp_path / "weights" / "v000999").exists() and (tmp_path / "weights" / f"v{steps:06d}").is_dir()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["generator gen-0", "learner rank 0"]
    by_process: dict[str, dict[str, int]] = {name: {} for name in processes.values()}
    for e in events:
        if e["ph"] == "X":
            counts = by_process[processes[e["pid"]]]
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    learner, generator = by_process["learner rank 0"], by_process["generator gen-0"]
    # ci-tiny trains in one micro-batch per step.
    assert {learner[k] for k in ("forward", "backward", "optimizer_step", "publish", "wait_batch")} == {steps}
    assert learner["answer WorkRequest"] >= steps  # the coordinator's thread, in the learner's row
    assert generator["ask"] >= steps and generator["generate"] >= steps
    # A generator takes the newest version when it looks, so it skips one published while it generated:
    # 18 to 20 loads in 20 steps.
    assert generator["weight_load"] >= steps // 2
    records = read_metrics(tmp_path)
    for r in records:
        parts = r["wait_rollouts_s"] + r["wait_buffer_s"] + r["wait_housekeeping_s"] + r["wait_other_s"]
        assert min(r["wait_rollouts_s"], r["wait_buffer_s"], r["wait_other_s"]) >= 0
        assert parts == pytest.approx(r["wait_s"], abs=0.005), r


def test_the_summary_ranks_each_process_spans_by_total_time():
    events = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "learner rank 0"}},
        {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "generator gen-0"}},
        {"name": "forward", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10_000},
        {"name": "backward", "ph": "X", "pid": 1, "tid": 1, "ts": 10_000, "dur": 30_000},
        {"name": "forward", "ph": "X", "pid": 1, "tid": 1, "ts": 40_000, "dur": 10_000},
        {"name": "generate", "ph": "X", "pid": 2, "tid": 5, "ts": 0, "dur": 100_000},
    ]
    lines = trace.summary(events).splitlines()
    assert lines[0] == "0.1 s traced"
    learner = lines.index("learner rank 0")
    assert lines[learner + 1].split()[:2] == ["backward", "1"] and lines[learner + 1].endswith("30.0%")
    assert lines[learner + 2].split()[:2] == ["forward", "2"] and "10.00 ms" in lines[learner + 2]
    assert lines[lines.index("generator gen-0") + 1].endswith("100.0%")


def test_the_trace_flag_also_takes_the_config_keys_values(capsys):
    """``--trace`` alone, or ``--trace=true`` / ``--trace=false`` as the ``trace`` key takes them (a benchmark passes
    settings in the second form); anything else is argparse's error naming the flag."""
    from asyncrl.launch.cli import _parser

    def traced(*flags: str) -> bool:
        args, overrides = _parser().parse_known_args(["run", "configs/quickstart.yaml", *flags])
        assert overrides == []
        return args.trace

    assert traced() is False
    assert traced("--trace") is True
    assert traced("--trace=true") is True
    assert traced("--trace=off") is False
    with pytest.raises(SystemExit):
        traced("--trace=maybe")
    assert "--trace: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_the_trace_flag_alone_reaches_every_process_as_an_override_its_command_line_reads(monkeypatch):
    """``asyncrl run CONFIG --trace`` and nothing else: the override follows the config in each child's command
    line, where a generator takes several configs (shared-engine runs)."""
    from asyncrl.launch import cli, local
    from generators import cli as generator_cli

    handed = []

    def run(config, overrides, *args, **kwargs):
        handed.append(overrides)
        raise SystemExit(0)

    monkeypatch.setattr(local, "run", run)
    with pytest.raises(SystemExit):
        cli.main(["run", "configs/ci-tiny.yaml", "--trace"])
    [overrides] = handed
    args, rest = generator_cli._parser().parse_known_args(["configs/ci-tiny.yaml", *overrides])
    assert args.config == ["configs/ci-tiny.yaml"] and rest == ["--trace=true"]
