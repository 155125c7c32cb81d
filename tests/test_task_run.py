"""A run on a dataset file, as a user brings one: bad rows are skipped and counted, training goes on."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, asyncrl_run

pytestmark = pytest.mark.slow

# What these runs test is the task (its rows, rewards and evaluation), not the generator's backend: the
# transformers backend starts seconds sooner than vLLM's engine on a CPU (runs through vLLM: test_integration).
BACKEND = "--generator.backend=transformers"


def test_a_run_trains_on_a_jsonl_dataset_and_counts_its_bad_rows(tmp_path):
    rows = [{"question": f"{n:03d}=", "answer": f"{n:03d}"} for n in range(0, 1000, 7)]
    lines = [json.dumps(r) for r in rows] + [
        "{broken",
        json.dumps({"answer": "1"}),
        json.dumps({"question": 5, "answer": "5"}),
    ]
    (tmp_path / "copy.jsonl").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        run_dir,
        "--learner.total_steps=150",
        f"--task.dataset={tmp_path / 'copy.jsonl'}",
        "--task.input_key=question",
        "--task.label_key=answer",
        "--task.max_prompt_tokens=5",
        BACKEND,
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 150
    assert summary["task_rows_skipped"] == {"malformed_json": 1, "missing_input": 1, "input_not_text": 1}
    consumed = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert {c["prompt"] for c in consumed} <= set(range(len(rows))), "prompt indices address the dataset's rows"
    # measured on 2 cores, two runs at once: 0.07 -> 0.375 and 0.38 in 150 steps (60 steps rose 0.10-0.13: too
    # close to a bound to hold)
    assert summary["reward_end"] > summary["reward_start"] + 0.2


def test_a_run_trains_on_a_verl_style_parquet_file_of_conversations_as_it_is(tmp_path):
    """verl's layout: ``prompt`` a list of chat messages, the label in ``reward_model.ground_truth``; the model
    has a chat template (one made for the tiny model's digit vocabulary)."""
    import shutil

    from datasets import Dataset

    model = tmp_path / "model"
    shutil.copytree(ROOT / "assets/tiny-llama", model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    rows = [
        {
            "data_source": "copy",
            "prompt": [{"role": "user", "content": f"{n:03d}"}],
            "reward_model": {"style": "rule", "ground_truth": f"{n:03d}"},
        }
        for n in range(0, 1000, 7)
    ]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    run_dir = tmp_path / "run"
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        run_dir,
        "--learner.total_steps=20",
        f"--model.path={model}",
        f"--task.dataset={tmp_path / 'train.parquet'}",
        "--task.label_key=reward_model.ground_truth",
        "--task.reward=asyncrl.tasks.digits:digit_reward",
        BACKEND,
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and not summary.get("task_rows_skipped")
    assert summary["reward_start"] > 0, "rewards scored against the nested ground truth"


def test_held_out_evaluation_runs_beside_training_and_standalone(tmp_path):
    rows = [{"question": f"{n:02d}=", "answer": f"{n:02d}"} for n in range(100)]
    (tmp_path / "copy2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    common = [
        f"--task.dataset={tmp_path / 'copy2.jsonl'}",
        "--task.input_key=question",
        "--task.label_key=answer",
        "--task.eval_fraction=0.2",
        "--task.reward=asyncrl.tasks.digits:digit_reward",
        "--eval.k=4",
        "--generator.max_new_tokens=3",
        BACKEND,  # in both commands
    ]
    out = asyncrl_run(
        "configs/ci-tiny.yaml", run_dir, "--learner.total_steps=60", "--eval.every_steps=20", *common, timeout_s=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 20, 40, 60] and all(e["prompts"] == 20 for e in evals)
    traces = [json.loads(line) for line in (run_dir / "eval" / "v000060.jsonl").read_text().splitlines()]
    assert len(traces) == 20 * (1 + 4) and sum(t["greedy"] for t in traces) == 20
    assert {t["version"] for t in traces} == {60}
    assert all(t["label"] == t["prompt"].removesuffix("=") for t in traces), "each trace names its reference answer"
    summary = json.loads((run_dir / "summary.json").read_text())["eval"]
    assert summary["pass@1_start"] == evals[0]["pass@1"] and summary["pass@1_final"] == evals[-1]["pass@1"]
    assert summary["pass@1_best"] == max(e["pass@1"] for e in evals)
    assert summary["pass@4_final"] >= summary["pass@1_final"] - 0.15  # k samples rarely do worse than greedy
    standalone = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "eval",
            str(ROOT / "configs/ci-tiny.yaml"),
            "--weights",
            str(run_dir / "weights" / "v000060"),
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert standalone.returncode == 0, standalone.stderr[-3000:]
    result = json.loads(standalone.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 20
    assert abs(result["pass@1"] - evals[-1]["pass@1"]) <= 0.05, "greedy answers of the same weights agree"


def _evaluated_copy_run(tmp_path, *overrides: str):
    """A run on two-digit copies with a fifth of them held out for evaluation; its run folder."""
    rows = [{"question": f"{n:02d}=", "answer": f"{n:02d}"} for n in range(100)]
    (tmp_path / "copy2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        run_dir,
        f"--task.dataset={tmp_path / 'copy2.jsonl'}",
        "--task.input_key=question",
        "--task.label_key=answer",
        "--task.eval_fraction=0.2",
        "--task.reward=asyncrl.tasks.digits:digit_reward",
        "--generator.max_new_tokens=3",
        BACKEND,
        *overrides,
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def test_a_time_budget_finishes_the_run_with_its_final_evaluation(tmp_path):
    run_dir = _evaluated_copy_run(
        tmp_path, "--learner.total_steps=100000", "--learner.max_train_s=5", "--eval.every_steps=1000"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 1 <= summary["steps"] < 100000
    assert summary["wall_s"] >= 5
    log = (run_dir / "logs/learner.log").read_text()
    assert f"learner.max_train_s (5 s) spent after {summary['steps']} steps: finishing" in log, log[-3000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, summary["steps"]], "the last version is evaluated as after total_steps"


def test_an_evaluation_due_between_publishes_evaluates_the_next_version_published(tmp_path):
    """eval.every_steps 5 with a version published every 4 steps: the evaluations due at steps 5 and 10 take the
    versions published at steps 8 and 12 (v2, v3), and v3, the last, is not evaluated twice."""
    run_dir = _evaluated_copy_run(
        tmp_path, "--learner.total_steps=14", "--learner.publish_every_steps=4", "--eval.every_steps=5"
    )
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert sorted((e["step"], e["version"]) for e in evals) == [(0, 0), (8, 2), (12, 3)]


def flaky_digit_reward(response: str, item: dict) -> float:
    """The digits reward, failing for about a tenth of responses (those that start with a 1)."""
    if response.strip().startswith("1"):
        raise ValueError("the grader is down")
    from asyncrl.tasks.digits import digit_reward

    return digit_reward(response, item)


def test_a_run_with_a_failing_reward_trains_on_the_rewards_that_were_scored(tmp_path):
    import os

    from asyncrl.observe.metrics import read_metrics

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        run_dir,
        "--learner.total_steps=100",
        "--task.reward=test_task_run:flaky_digit_reward",
        BACKEND,
        timeout_s=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir)
    failed = sum(r["reward_failed"] for r in records)
    assert summary["steps"] == 100 and summary["reward_failures"]["ValueError"] >= failed > 0
    assert all(r["loss"] == r["loss"] for r in records), "no NaN reaches the loss"
    assert summary["reward_end"] > summary["reward_start"] + 0.1, (summary["reward_start"], summary["reward_end"])


def broken_reward(completions, **kwargs) -> list[float]:
    """A reward written for another library's signature: it fails on every sample."""
    return [1.0 for _ in completions]


def test_a_run_whose_every_reward_fails_from_the_start_stops_and_says_why(tmp_path):
    import os

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = asyncrl_run(
        "configs/ci-tiny.yaml",
        run_dir,
        "--learner.total_steps=100",
        "--task.unscored_steps_to_fail=3",
        "--task.reward=test_task_run:broken_reward",
        BACKEND,
        timeout_s=300,
        env=env,
    )
    assert out.returncode == 1
    assert "no reward was scored in the first 3 steps: every reward failed (TypeError: " in out.stderr, out.stderr[
        -3000:
    ]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_steps_whose_rewards_all_failed_are_left_out_of_the_reward_and_the_closing_line_says_so(tmp_path, capsys):
    import time

    from asyncrl.config import load_config
    from asyncrl.launch.cli import _print_summary
    from asyncrl.launch.progress import summarize

    rewards = [0.25, None, 0.75]  # step 2: the reward server was down for the whole batch
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": i + 1, "wall_s": i, "reward": r, "staleness_max": 0}) + "\n"
            for i, r in enumerate(rewards)
        )
    )
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "steps": 3,
                "wall_s": 3.0,
                "achieved_samples_per_s": 10,
                "pipeline_efficiency": 0.9,
                "generator_capacity_samples_per_s": 12,
                "learner_capacity_samples_per_s": 20,
                "max_staleness": 1,
                "samples_dropped": {},
                "reward_failures": {"timeout": 6, "ValueError": 2},
            }
        )
    )
    summary = summarize(load_config(None), tmp_path, time.monotonic())
    assert (summary["reward_start"], summary["reward_end"]) == (0.25, 0.75), "the failed step is not a 0"
    _print_summary("run", summary)
    assert "rewards failed 8 times (ValueError 2, timeout 6;" in capsys.readouterr().out

    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "wall_s": 0, "reward": None, "staleness_max": 0}) + "\n"
    )
    summary = summarize(load_config(None), tmp_path, time.monotonic())
    assert summary["reward_start"] is None
    _print_summary("run", summary)
    assert "no reward scored; rewards failed 8 times" in capsys.readouterr().out
