"""``asyncrl sweep``: grids, folder names, time to target, resume and the report, on hand-made run dirs;
and one real tiny sweep through the CLI (slow)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from asyncrl import run_folder
from asyncrl.config import ConfigError
from asyncrl.launch.sweep import grid, runner
from asyncrl.launch.sweep import report as sweep_report
from asyncrl.launch.sweep.plots import _eval, band

CONFIG = str(ROOT / "configs/ci-tiny.yaml")
GRIDS = [("staleness.max_staleness", ("0", "2")), ("algo.off_policy", ("none", "tis"))]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _fake_run(
    out: Path,
    cell: grid.Cell,
    seed: int,
    rewards: list[float],
    *,
    sps: float = 100.0,
    stale: int = 0,
    evals: list[tuple[int, float]] = (),
    staleness: list[int] = (0, 1),
    step_s: float = 1.0,
) -> Path:
    """A finished run dir as ``asyncrl run`` leaves it: summary.json, metrics/consumed/eval .jsonl."""
    path = grid.run_path(out, cell, seed)
    path.mkdir(parents=True)
    records = [
        {"step": i + 1, "wall_s": step_s * (i + 1), "reward": r, "mismatch_kl": 0.01 * (seed + 1)}
        for i, r in enumerate(rewards)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "consumed.jsonl").write_text(
        "".join(json.dumps({"id": f"r{i}", "staleness": s}) + "\n" for i, s in enumerate(staleness))
    )
    if evals:
        (path / "eval.jsonl").write_text(
            "".join(json.dumps({"step": s, "pass@1": p, "pass@4": p}) + "\n" for s, p in evals)
        )
    summary = {
        "steps": len(rewards),
        "samples_consumed": 90,
        "samples_dropped": {"stale": stale} if stale else {},
        "achieved_samples_per_s": sps,
        "pipeline_efficiency": 0.9,
        "reward_end": rewards[-1],
        "eval": {"pass@1_final": evals[-1][1]} if evals else {},
        "total_wall_s": step_s * len(rewards),
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _fake_launcher(monkeypatch, outcomes: list, on_start=lambda: None) -> list[tuple]:
    """``asyncrl run`` as ``run_one`` starts it, without a process: each ``wait`` takes the next of ``outcomes``
    (an exit code, or an exception to raise), ``on_start`` writes what its learner would. Returns the calls."""
    calls = []

    class Launcher:
        def __init__(self, cmd, **kwargs):
            self.returncode = None
            on_start()

        def wait(self, timeout=None):
            calls.append(("wait", timeout))
            outcome = outcomes.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            self.returncode = outcome
            return outcome

        def poll(self):
            return self.returncode

        def send_signal(self, signum):
            calls.append(("signal", signum))

        def kill(self):
            calls.append(("kill",))
            self.returncode = -signal.SIGKILL

    monkeypatch.setattr(runner.subprocess, "Popen", Launcher)
    return calls


def _open(out: Path, grids=GRIDS, seeds: int = 2, target: float | None = 0.5) -> list[grid.Cell]:
    runner.open_out(out, runner.definition(CONFIG, grids, seeds, ["--learner.total_steps=20"]), target)
    return grid.make_cells(grids)


# --- grids and cells ---------------------------------------------------------------------------


def test_parse_grid_splits_values_and_rejects_malformed_specs():
    assert grid.parse_grid("staleness.max_staleness=0,1, 2") == ("staleness.max_staleness", ("0", "1", "2"))
    assert grid.parse_grid("--algo.off_policy=tis") == ("algo.off_policy", ("tis",))
    for bad, why in [
        ("staleness.max_staleness", "expected KEY=V1"),
        ("=1,2", "expected KEY=V1"),
        ("algo.off_policy=tis,,none", "expected KEY=V1"),
        ("algo.off_policy=tis,tis", "listed twice"),
        ("learner.seed=1,2", "set by the sweep itself"),
        ("run_dir=a,b", "set by the sweep itself"),
    ]:
        with pytest.raises(ConfigError, match=why) as info:
            grid.parse_grid(bad)
        assert repr(bad) in str(info.value), "the error names the --grid it is about"


def test_validate_names_the_bad_grid_before_anything_runs(tmp_path):
    cells = runner.validate(CONFIG, GRIDS, ["--learner.total_steps=20"])
    assert [c.label for c in cells] == [
        "max_staleness=0, off_policy=none",
        "max_staleness=0, off_policy=tis",
        "max_staleness=2, off_policy=none",
        "max_staleness=2, off_policy=tis",
    ]
    with pytest.raises(ConfigError, match=r"--grid algo\.off_policy=none,bogus: value 'bogus'"):
        runner.validate(CONFIG, [GRIDS[0], ("algo.off_policy", ("none", "bogus"))], [])
    with pytest.raises(ConfigError, match=r"--grid staleness\.max_stalenes=1: .*max_stalenes"):
        runner.validate(CONFIG, [("staleness.max_stalenes", ("1",))], [])
    with pytest.raises(ConfigError, match=r"--grid staleness\.max_staleness=0,-1: value '-1'.*must be >= 0"):
        runner.validate(CONFIG, [("staleness.max_staleness", ("0", "-1"))], [])
    with pytest.raises(ConfigError, match="given twice"):
        runner.validate(CONFIG, [GRIDS[0], GRIDS[0]], [])
    with pytest.raises(ConfigError, match="overrides for every run.*learner.seed"):
        runner.validate(CONFIG, GRIDS, ["--learner.seed=3"])
    with pytest.raises(ConfigError, match=r"overrides for every run.*algo\.off_policy"):
        runner.validate(CONFIG, GRIDS, ["--algo.off_policy", "tis"])
    with pytest.raises(
        ConfigError,
        match=r"overrides for every run: override --learner\.total_step: unknown key "
        r"`learner\.total_step`; did you mean `learner\.total_steps`\?",
    ):
        runner.validate(CONFIG, GRIDS, ["--learner.total_step=20"])
    with pytest.raises(ConfigError, match="not found"):
        runner.validate(str(tmp_path / "nope.yaml"), GRIDS, [])


def test_cli_refuses_a_bad_grid_before_anything_runs(tmp_path, capsys):
    from asyncrl.launch.cli import main

    out = tmp_path / "sweep"
    args = ["sweep", CONFIG, "--grid", "staleness.max_staleness=0,2", "--out", str(out)]
    assert main([*args, "--grid", "algo.off_policy=none,bogus", "--", "--learner.total_steps=20"]) == 1
    assert "asyncrl sweep: --grid algo.off_policy=none,bogus: value 'bogus'" in capsys.readouterr().err
    assert main([*args, "--grid", "algo.off_policy"]) == 1
    assert "asyncrl sweep: --grid 'algo.off_policy': expected KEY=V1,V2" in capsys.readouterr().err
    assert main([*args, "--", "--learner.total_steps=0"]) == 1, "the overrides after -- are checked too"
    assert "overrides for every run: override --learner.total_steps: must be >= 1" in capsys.readouterr().err
    assert not out.exists(), "nothing is created, let alone run"


def test_side_by_side_refuses_runs_that_cannot_share_one_engine_before_anything_runs(tmp_path, capsys):
    from asyncrl.launch.cli import main

    out = tmp_path / "sweep"
    lora = str(ROOT / "configs/digits-copy-lora-vllm.yaml")
    cases = [
        ([CONFIG, "--grid", "learner.lr=1e-3,3e-3"], "learner.lora.rank: runs that share a generator"),
        ([lora, "--grid", "generator.vllm.max_model_len=256,512"], "generator.vllm differs from the cell"),
        ([lora, "--grid", "learner.lr=1e-3,3e-3", "--side-by-side", "0"], "--side-by-side must be >= 1"),
    ]
    for args, message in cases:
        side = [] if "--side-by-side" in args else ["--side-by-side", "2"]
        assert main(["sweep", *args, *side, "--out", str(out)]) == 1
        assert message in capsys.readouterr().err
    assert not out.exists(), "nothing is created, let alone run"


def test_validate_checks_each_cell_whole(tmp_path):
    """Two values valid alone can be invalid together: the error names the cell."""
    config = tmp_path / "c.yaml"
    config.write_text(Path(CONFIG).read_text().replace("max_new_tokens: 4", "max_new_tokens: 8"))
    grids = [("generator.max_new_tokens", ("4", "8")), ("algo.overlong_buffer", ("0", "6"))]
    with pytest.raises(ConfigError, match="the cell max_new_tokens=4, overlong_buffer=6: .*overlong_buffer"):
        runner.validate(str(config), grids, [])


def test_slugs_are_folder_safe_and_keep_keys_apart():
    cell = grid.Cell((("staleness.max_staleness", "2"), ("algo.off_policy", "tis")))
    assert cell.slug == "max_staleness-2__off_policy-tis"
    assert cell.overrides == ["--staleness.max_staleness=2", "--algo.off_policy=tis"]
    odd = grid.Cell((("task.system_prompt", "a b/c=d+"), ("learner.lr", "1e-5")))
    assert odd.slug == "system_prompt-a_b_c_d___lr-1e-5"
    # Only characters Path.as_uri() leaves alone: weights are announced as file:// URIs of the run dir.
    assert Path("/" + odd.slug).as_uri() == "file:///" + odd.slug
    same_leaf = grid.Cell((("learner.seed_x", "1"), ("generator.seed_x", "2")))
    assert same_leaf.slug == "learner.seed_x-1__generator.seed_x-2"
    assert grid.Cell(()).slug == "base"
    with pytest.raises(ConfigError, match="share the folder"):
        grid.make_cells([("task.system_prompt", ("a b", "a/b"))])


# --- time to target ----------------------------------------------------------------------------


def test_time_to_target_uses_the_running_mean_of_ten_steps():
    records = [{"step": i + 1, "wall_s": 2.0 * (i + 1), "reward": r} for i, r in enumerate([0.0] * 10 + [1.0] * 10)]
    # After k ones the mean of the last ten steps is k/10: 0.5 is first reached at the 5th one (step 15).
    assert sweep_report.time_to_target(records, 0.5) == (30.0, 15)
    assert sweep_report.time_to_target(records, 1.0) == (40.0, 20)
    assert sweep_report.time_to_target(records, 1.01) is None
    assert sweep_report.time_to_target(records, None) is None
    # A single spike does not count: one 1.0 among zeros is a mean of 0.1.
    spike = [{"step": i + 1, "wall_s": float(i + 1), "reward": 1.0 if i == 12 else 0.0} for i in range(20)]
    assert sweep_report.time_to_target(spike, 0.5) is None
    # Nor a lucky first step, which alone would be the whole mean of a window not yet full.
    lucky = [{"step": i + 1, "wall_s": float(i + 1), "reward": 0.8 if i == 0 else 0.1} for i in range(20)]
    assert sweep_report.time_to_target(lucky, 0.5) is None
    assert sweep_report.time_to_target(lucky, 0.17, window=10) == (10.0, 10)  # (0.8 + 9 * 0.1) / 10


def test_a_value_that_is_not_finite_spoils_only_its_own_windows():
    from asyncrl.observe.metrics import smooth

    assert smooth([1.0, float("inf"), 3.0, 4.0, 5.0], window=2) == [1.0, 1.0, 3.0, 3.5, 4.5]


# --- resume --------------------------------------------------------------------------------------


def test_pending_runs_keeps_finished_and_clears_half_finished(tmp_path):
    cells = _open(tmp_path)
    done = _fake_run(tmp_path, cells[0], 0, [0.1, 0.2])
    half = grid.run_path(tmp_path, cells[0], 1)
    (half / "logs").mkdir(parents=True)
    (half / "metrics.jsonl").write_text("{}\n")
    todo = runner.pending_runs(tmp_path, cells, 2)
    assert (cells[0], 0) not in todo and (done / "summary.json").exists()
    assert (cells[0], 1) in todo and not half.exists(), "a half-finished run dir is removed, to start clean"
    assert len(todo) == 7
    # A run whose learner wrote summary.json and which failed after it (a plot, the launcher's summary) is no
    # finished run: the report counts it failed and a resume runs it again.
    late = _fake_run(tmp_path, cells[1], 0, [0.1, 0.2])
    (late / "error.txt").write_text("exit code 1\n")
    assert sweep_report.load_run(tmp_path, cells[1], 0, None).status == "failed"
    assert (cells[1], 0) in runner.pending_runs(tmp_path, cells, 2) and not late.exists()


def test_a_run_interrupted_after_its_learners_summary_is_no_finished_run(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM reaches the sweep after the learner wrote summary.json and before the launcher ended:
    the run has a summary.json and no error.txt, yet only a run that exited 0 is kept on a resume."""
    cells = _open(tmp_path, grids=[("staleness.max_staleness", ("0",))], seeds=1)
    path = grid.run_path(tmp_path, cells[0], 0)

    def learner_summary():
        (path / "summary.json").write_text(json.dumps({"steps": 7, "samples_consumed": 56}))

    # The first wait is interrupted; the second is _stop's, while the launcher stops what it started.
    _fake_launcher(monkeypatch, [KeyboardInterrupt(), 1], learner_summary)
    with pytest.raises(KeyboardInterrupt):
        runner.run_one(CONFIG, cells[0], 0, [], path, 60)
    assert (path / "summary.json").exists() and not (path / "error.txt").exists()
    assert not grid.finished(path)
    assert sweep_report.load_run(tmp_path, cells[0], 0, None).status == "missing"
    assert runner.pending_runs(tmp_path, cells, 1) == [(cells[0], 0)] and not path.exists(), "rerun from scratch"

    def whole_summary():  # the launcher adds its part once every process stopped
        (path / "summary.json").write_text(json.dumps({"steps": 7, "samples_consumed": 56, "total_wall_s": 9.5}))

    _fake_launcher(monkeypatch, [0], whole_summary)
    assert runner.run_one(CONFIG, cells[0], 0, [], path, 60) is None
    assert grid.finished(path) and runner.pending_runs(tmp_path, cells, 1) == []


def test_run_one_gives_the_launcher_the_runs_stop_timeout_before_killing_it(tmp_path, monkeypatch):
    """On a timeout (or Ctrl-C) the launcher waits up to learner.stop_timeout_s for the learner to checkpoint:
    it is not killed sooner, lest the next run start while the learner still holds the GPU."""
    cell = grid.Cell((("learner.stop_timeout_s", "300"),))  # a grid value too: each run's own config
    calls = _fake_launcher(monkeypatch, [subprocess.TimeoutExpired("asyncrl run", 1.0), 0])
    stop_s = 300 + runner.STOP_MARGIN_S
    error = runner.run_one(CONFIG, cell, 0, [], tmp_path / "run", 60)
    assert calls == [("wait", 60 + runner.KILL_GRACE_S + stop_s), ("signal", signal.SIGINT), ("wait", stop_s)]
    assert error.startswith(f"still running after {60 + runner.KILL_GRACE_S + stop_s:.0f}s")

    calls = _fake_launcher(monkeypatch, [KeyboardInterrupt(), subprocess.TimeoutExpired("asyncrl run", 1.0), 0])
    with pytest.raises(KeyboardInterrupt):
        runner.run_one(CONFIG, cell, 1, ["--learner.stop_timeout_s=7"], tmp_path / "run2", 60)
    assert calls[1:] == [("signal", signal.SIGINT), ("wait", 7 + runner.STOP_MARGIN_S), ("kill",), ("wait", None)]


def test_a_second_sweep_in_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    run_folder.claim(tmp_path / "out", "sweep")  # as the first sweep holds it (this process)
    other = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "sweep",
            CONFIG,
            "--grid",
            "staleness.max_staleness=0,1",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert other.returncode == 1
    assert f"sweep folder {(tmp_path / 'out').resolve()} is in use by another sweep (pid " in other.stderr
    run_folder.release(tmp_path / "out")


def test_a_different_sweep_is_refused_in_the_same_folder(tmp_path):
    _open(tmp_path, seeds=2, target=0.5)
    _open(tmp_path, seeds=2, target=None)  # the same sweep: resumes
    assert json.loads((tmp_path / "sweep.json").read_text())["target_reward"] == 0.5, "an unset target keeps"
    with pytest.raises(RuntimeError, match="seeds differ"):
        _open(tmp_path, seeds=3)
    with pytest.raises(RuntimeError, match="grids differ"):
        _open(tmp_path, grids=GRIDS[:1])
    with pytest.raises(RuntimeError, match="extra_overrides differ"):
        runner.open_out(tmp_path, runner.definition(CONFIG, GRIDS, 2, []), None)


def test_sweep_runs_only_what_is_left_and_goes_on_after_a_failure(tmp_path, monkeypatch):
    """The runner's loop with ``run_one`` replaced: finished runs are skipped, a failure is recorded."""
    cells = _open(tmp_path, seeds=1)
    _fake_run(tmp_path, cells[0], 0, [0.1, 0.6])
    calls = []

    def fake_run_one(config, cell, seed, extra, path, timeout_s):
        calls.append((cell.label, seed, extra))
        if cell == cells[1]:
            path.mkdir(parents=True)
            (path / "error.txt").write_text("exit code 1\nboom\n")
            return "exit code 1: boom"
        _fake_run(tmp_path, cell, seed, [0.2, 0.7])
        return None

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    report, failed = runner.sweep(CONFIG, GRIDS, 1, tmp_path, ["--learner.total_steps=20"], None, 60)
    assert failed == 1
    assert [c[0] for c in calls] == [c.label for c in cells[1:]], "the finished run is not redone"
    assert calls[0][2] == ["--learner.total_steps=20"]
    rows = _rows(tmp_path / "sweep.csv")
    statuses = {(r["staleness.max_staleness"], r["algo.off_policy"]): r["status"] for r in rows}
    assert statuses == {("0", "none"): "ok", ("0", "tis"): "failed", ("2", "none"): "ok", ("2", "tis"): "ok"}
    assert "## Failed runs" in report.read_text() and "max_staleness=0, off_policy=tis, seed 0" in report.read_text()


def test_run_one_records_a_failed_runs_output(tmp_path):
    """A real subprocess that fails at once (an override the learner rejects is caught by ``asyncrl run``)."""
    cell = grid.Cell((("staleness.max_staleness", "1"),))
    path = tmp_path / "run"
    error = runner.run_one(CONFIG, cell, 0, ["--learner.total_steps=0"], path, 60)
    assert error is not None and error.startswith("exit code 1")
    text = (path / "error.txt").read_text()
    assert "learner.total_steps" in text, "the tail of the run's stderr is kept"
    assert "--learner.seed=0" in (path / "sweep-run.log").read_text().splitlines()[0], "the command is logged"


# --- the report ----------------------------------------------------------------------------------


def test_report_from_fake_run_dirs(tmp_path):
    cells = _open(tmp_path, seeds=2, target=0.5)
    sync_none, sync_tis, async_none, async_tis = cells
    ramp = [0.0] * 10 + [1.0] * 10  # reaches 0.5 at step 15
    # The sync cell takes 2 s a step, the async one 1 s: a speedup of 2.
    for seed in range(2):
        _fake_run(
            tmp_path,
            sync_none,
            seed,
            ramp,
            step_s=2.0,
            sps=50.0 + seed,
            evals=[(0, 0.1), (10, 0.3), (20, 0.5)],
            staleness=[0] * 10,
        )
        _fake_run(
            tmp_path,
            async_none,
            seed,
            ramp,
            step_s=1.0,
            sps=100.0 + 2 * seed,
            stale=10,
            evals=[(0, 0.1), (10, 0.4), (20, 0.6)],
            staleness=[0, 1, 2, 2],
        )
    _fake_run(tmp_path, sync_tis, 0, [0.0] * 20)  # never reaches the target; seed 1 never ran
    # async_tis: both seeds failed
    for seed in range(2):
        path = grid.run_path(tmp_path, async_tis, seed)
        path.mkdir(parents=True)
        (path / "error.txt").write_text("exit code 1\n")
    report = sweep_report.build_report(tmp_path).read_text()

    rows = _rows(tmp_path / "sweep.csv")
    assert len(rows) == 8
    by = {(r["staleness.max_staleness"], r["algo.off_policy"], r["seed"]): r for r in rows}
    assert by["2", "none", "1"]["status"] == "ok" and by["0", "tis", "1"]["status"] == "missing"
    assert by["2", "tis", "0"]["status"] == "failed"
    assert float(by["2", "none", "1"]["achieved_samples_per_s"]) == 102.0
    assert float(by["2", "none", "0"]["eval.pass@1_final"]) == 0.6, "nested summary keys are flattened"
    assert float(by["2", "none", "0"]["samples_dropped.stale"]) == 10
    assert float(by["2", "none", "0"]["stale_drop_rate"]) == 0.1  # 10 / (90 + 10)
    assert float(by["0", "none", "0"]["time_to_target_s"]) == 30.0 and by["0", "none", "0"]["steps_to_target"] == "15"
    assert float(by["2", "none", "0"]["time_to_target_s"]) == 15.0
    assert by["0", "tis", "0"]["time_to_target_s"] == ""
    assert float(by["2", "none", "1"]["mismatch_kl_mean"]) == pytest.approx(0.02)

    for cell in cells:
        assert f"| {cell.label} |" in report
    table = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| max")}
    assert "async/sync speedup" in report
    # ... | time to target (s) | reached target | async/sync speedup |
    assert table["max_staleness=2, off_policy=none"].endswith("| 15.0 ± 0.0 | 2/2 | 2.00x |")
    assert table["max_staleness=0, off_policy=none"].endswith("| 30.0 ± 0.0 | 2/2 | baseline |")
    assert table["max_staleness=2, off_policy=tis"].endswith("| - | 0/0 | - |"), "no speedup without finished runs"
    assert table["max_staleness=0, off_policy=tis"].endswith("| - | 0/1 | baseline |")
    assert "| 101.0 ± 1.4 |" in table["max_staleness=2, off_policy=none"], "samples/s: mean ± sample std"
    assert "| 0.600 ± 0.000 |" in table["max_staleness=2, off_policy=none"], "held-out pass@1 final"
    assert "| 0/2 |" in table["max_staleness=2, off_policy=tis"], "runs finished per cell"
    assert "| 1/2 |" in table["max_staleness=0, off_policy=tis"]
    assert "## Failed runs" in report and "`samples_dropped.stale`" in report
    for png in ("reward.png", "eval_pass1.png", "mismatch_kl.png", "samples_per_s.png", "staleness.png"):
        assert (tmp_path / png).stat().st_size > 5000, png
        assert f"]({png})" in report, f"{png} is embedded"


def test_speedup_needs_a_sync_cell_and_a_target(tmp_path):
    def header(out: Path, target: float | None = None) -> str:
        report = sweep_report.build_report(out, target).read_text()
        return next(line for line in report.splitlines() if line.startswith("| cell"))

    with_sync = [("staleness.max_staleness", ("0", "2"))]
    for cell in _open(tmp_path / "a", grids=with_sync, seeds=1, target=None):
        _fake_run(tmp_path / "a", cell, 0, [0.1] * 10 + [1.1])
    assert "speedup" not in header(tmp_path / "a") and "time to target" not in header(tmp_path / "a")
    assert "held-out pass@1" not in header(tmp_path / "a"), "no eval column without evaluations"
    assert not (tmp_path / "a" / "eval_pass1.png").exists()
    # A target given to build_report alone is used: the ten-step means are 0.1 at step 10, 0.2 at step 11.
    assert "| time to target (s) | reached target | async/sync speedup |" in header(tmp_path / "a", 0.2)
    assert float(_rows(tmp_path / "a" / "sweep.csv")[0]["time_to_target_s"]) == 11.0

    without_sync = [("algo.off_policy", ("none", "tis"))]
    for cell in _open(tmp_path / "b", grids=without_sync, seeds=1, target=0.2):
        _fake_run(tmp_path / "b", cell, 0, [0.1, 0.2, 0.3])
    assert "time to target" in header(tmp_path / "b") and "speedup" not in header(tmp_path / "b")


def test_speedup_says_how_many_seeds_reached_the_target(tmp_path):
    """A mean time to target over only the seeds that reached it is no plain speedup: the lucky seed alone."""
    grids = [("staleness.max_staleness", ("0", "2", "4"))]
    sync, async2, async4 = _open(tmp_path, grids=grids, seeds=3, target=0.5)
    ramp, flat = [0.0] * 10 + [1.0] * 10, [0.0] * 20  # the ramp reaches 0.5 at step 15
    for seed in range(3):
        _fake_run(tmp_path, sync, seed, ramp, step_s=2.0)  # 30 s, every seed
        _fake_run(tmp_path, async2, seed, ramp if seed == 0 else flat)  # 15 s, one seed of three
        _fake_run(tmp_path, async4, seed, flat)  # never
    report = sweep_report.build_report(tmp_path).read_text()
    table = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| max")}
    assert table["max_staleness=2"].endswith("| 15.0 | 1/3 | 2.00x (1/3 vs 3/3 reached) |")
    assert table["max_staleness=4"].endswith("| - | 0/3 | - |")
    assert "only where every finished seed of both cells reached the target" in report, "the legend says so"

    for seed in range(3):  # every seed of the async cell reaches it: a plain ratio
        runner.shutil.rmtree(grid.run_path(tmp_path, async2, seed))
        _fake_run(tmp_path, async2, seed, ramp)
    report = sweep_report.build_report(tmp_path).read_text()
    assert "| 15.0 ± 0.0 | 3/3 | 2.00x |" in report


def test_a_mismatch_kl_that_is_not_finite_is_left_out_and_the_report_builds(tmp_path):
    from asyncrl.observe.metrics import read_metrics

    cells = _open(tmp_path, grids=GRIDS[:1], seeds=2, target=None)
    for seed in range(2):
        path = _fake_run(tmp_path, cells[0], seed, [0.1] * 5)  # mismatch_kl 0.01 * (seed + 1) at every step
        records = read_metrics(path)
        records[1]["mismatch_kl"] = math.inf  # a step whose KL overflowed
        records[2]["mismatch_kl"] = math.nan
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = sweep_report.build_report(tmp_path).read_text()
    means = [float(r["mismatch_kl_mean"]) for r in _rows(tmp_path / "sweep.csv") if r["status"] == "ok"]
    assert means == [pytest.approx(0.01), pytest.approx(0.02)]
    assert "| 1.50e-02 ± 7.07e-03 |" in report
    assert sweep_report._stat([1.0, math.inf, None, 3.0, math.nan], ".1f") == "2.0 ± 1.4"
    assert sweep_report._stat([math.inf, math.nan], ".1f") == "-"


def test_the_eval_curve_follows_the_step_not_the_order_evaluations_finished():
    """Evaluations can finish out of order; ``band`` needs its x sorted, or the run has no curve at all."""
    from types import SimpleNamespace

    evals = [
        {"step": 20, "version": 2, "pass@1": 1.0},
        {"step": 0, "version": 0, "pass@1": 0.0},
        {"step": 10, "version": 1, "pass@1": 0.5},
    ]
    run = SimpleNamespace(evals=evals, records=[{"step": s, "wall_s": 2.0 * s} for s in range(1, 21)])
    assert _eval(wall=False)(run) == ([0, 10, 20], [0.0, 0.5, 1.0])
    x, mean, _, _ = band([_eval(wall=False)(run)])
    assert list(x) == [0, 10, 20] and list(mean) == [0.0, 0.5, 1.0]
    assert _eval(wall=True)(run) == ([0.0, 20.0, 40.0], [0.0, 0.5, 1.0])


def test_band_averages_seeds_over_the_range_they_share():
    x, mean, low, high = band([([0, 1, 2, 3], [0, 1, 2, 3]), ([1, 2, 3, 4], [3, 3, 3, 3])])
    assert list(x) == [1, 2, 3]
    assert list(mean) == [2, 2.5, 3] and list(low) == [1, 2, 3] and list(high) == [3, 3, 3]


# --- end to end ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_sweep_end_to_end_and_resume(tmp_path):
    """Four real tiny runs through the CLI; then one summary.json removed and only that run is redone.

    The generators use the transformers backend: what is tested is the sweep, and it starts in seconds
    where vLLM on a CPU takes tens of seconds per run."""
    out = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "sweep",
        CONFIG,
        "--grid",
        "staleness.max_staleness=0,2",
        "--grid",
        "algo.off_policy=none,tis",
        "--seeds",
        "1",
        "--out",
        str(out),
        "--target-reward",
        "0.08",
        "--timeout-s",
        "300",
        "--",
        "--learner.total_steps=20",
        "--generator.backend=transformers",
    ]
    subprocess.run(cmd, check=True, timeout=600, cwd=ROOT)
    rows = _rows(out / "sweep.csv")
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    assert {r["steps"] for r in rows} == {"20"}, "the extra override reached every run"
    assert {(r["max_staleness"], r["staleness.max_staleness"]) for r in rows} == {("0", "0"), ("2", "2")}
    for row in rows:  # each run got its cell's values (the resolved config written next to its outputs)
        config = yaml.safe_load((Path(row["run_dir"]) / "config.yaml").read_text())
        assert config["algo"]["off_policy"] == row["algo.off_policy"]
        assert config["learner"]["seed"] == config["generator"]["seed"] == 0
    report = (out / "report.md").read_text()
    cells = grid.make_cells(GRIDS)
    for cell in cells:
        assert f"| {cell.label} |" in report
    assert "async/sync speedup" in report
    for png in ("reward.png", "mismatch_kl.png", "samples_per_s.png", "staleness.png"):
        assert (out / png).exists(), png

    summaries = {c: grid.run_path(out, c, 0) / "summary.json" for c in cells}
    for path in summaries.values():  # dated in the past, so that a rewrite shows whatever the clock's resolution
        os.utime(path, ns=(0, 0))
    redo = cells[3]
    summaries[redo].unlink()
    subprocess.run(cmd, check=True, timeout=600, cwd=ROOT)
    assert summaries[redo].exists(), "the run without summary.json was run again"
    assert all(summaries[c].stat().st_mtime_ns == 0 for c in cells if c != redo), "the others were not"
    assert {r["status"] for r in _rows(out / "sweep.csv")} == {"ok"}


def test_a_run_completed_beside_one_that_failed_is_kept_not_marked_failed(tmp_path, monkeypatch):
    """Runs side by side share one launcher, whose exit status is the group's: a run it completed must not be
    given another run's error, counted failed and run again."""
    from asyncrl.launch.sweep import runner
    from asyncrl.launch.sweep.grid import Cell, finished, run_path

    cells = [Cell(values=(("learner.lr", "0.001"),)), Cell(values=(("learner.lr", "0.002"),))]

    def launch(cmd, log_path, limit_s, stop_s):  # the first run completes; the second fails
        (run_path(tmp_path, cells[0], 0) / "summary.json").write_text(json.dumps({"total_wall_s": 12.0}))
        return 1, "exit code 1", ["the second run failed"]

    monkeypatch.setattr(runner, "_launch", launch)
    errors = runner.run_group("configs/quickstart.yaml", [(c, 0) for c in cells], [], tmp_path, timeout_s=60.0)
    assert errors[0] is None and errors[1].startswith("exit code 1")
    assert finished(run_path(tmp_path, cells[0], 0)) and not finished(run_path(tmp_path, cells[1], 0))


def test_the_run_a_sweep_started_stops_when_the_sweep_is_killed(tmp_path):
    """SIGKILL or the out-of-memory killer leaves a sweep no handler: its run, in a session of its own, gets
    SIGTERM from the kernel rather than training on beside the next sweep's."""
    import time

    from conftest import ROOT

    log, run = tmp_path / "run.log", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    sweep_code = (
        "import sys; from pathlib import Path; from asyncrl.launch.sweep import runner; "
        f"runner._launch([sys.executable, '-c', {run!r}], Path({str(log)!r}), 120, 5)"
    )
    sweep = subprocess.Popen([sys.executable, "-c", sweep_code], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) > 1):
        assert time.monotonic() < deadline and sweep.poll() is None, "the run never started"
        time.sleep(0.1)
    child = int(log.read_text().splitlines()[1])
    sweep.kill()
    sweep.wait(timeout=30)
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < deadline, "the run trained on after its sweep was killed"
        time.sleep(0.1)
