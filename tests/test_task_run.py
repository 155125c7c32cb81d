"""A run on a dataset file, as a user brings one: bad rows are skipped and counted, training goes on."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_a_run_trains_on_a_jsonl_dataset_and_counts_its_bad_rows(tmp_path):
    rows = [{"question": f"{n:03d}=", "answer": f"{n:03d}"} for n in range(0, 1000, 7)]
    lines = [json.dumps(r) for r in rows] + ["{broken", json.dumps({"answer": "1"}), json.dumps({"question": 5,
                                                                                                 "answer": "5"})]
    (tmp_path / "copy.jsonl").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", str(ROOT / "configs/ci-tiny.yaml"), "--run-dir", str(run_dir),
         "--free-ports", "--timeout-s", "300", "--learner.total_steps=60", f"--task.dataset={tmp_path / 'copy.jsonl'}",
         "--task.input_key=question", "--task.label_key=answer", "--task.max_prompt_tokens=5"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60
    assert summary["task_rows_skipped"] == {"malformed_json": 1, "missing_input": 1, "input_not_text": 1}
    consumed = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert {c["prompt"] for c in consumed} <= set(range(len(rows))), "prompt indices address the dataset's rows"
    assert summary["reward_end"] > summary["reward_start"] + 0.1  # measured: 0.06 -> 0.20 in 60 steps
