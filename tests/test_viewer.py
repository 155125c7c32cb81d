"""``asyncrl view``'s server on run folders whole, half-written and missing, and its guard beyond loopback."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from asyncrl.launch.viewer import data
from asyncrl.launch.viewer.server import check_bind, make_app
from learners.rollout_sample import RolloutSampler, spread


def write_run(root: Path, steps: int = 3, torn: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("name: tiny\nmodel:\n  path: /nowhere\n")
    lines = [
        json.dumps({"step": s, "reward": s / 10, "wall_s": s * 0.5, "samples_per_s": 100.0 + s})
        for s in range(1, steps + 1)
    ]
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n" + ('{"step": 4, "rew' if torn else ""))
    consumed = [
        {"id": f"g{s}-{i}", "step": s, "staleness": i % 2, "prompt": s, "generator": "gen-0"}
        for s in range(1, steps + 1)
        for i in range(2)
    ]
    (root / "consumed.jsonl").write_text("".join(json.dumps(c) + "\n" for c in consumed))
    (root / "eval.jsonl").write_text(json.dumps({"step": 0, "version": 0, "pass@1": 0.25, "pass@4": 0.5}) + "\n")
    return root


def test_curves_carry_the_runs_numbers_and_a_torn_last_line_is_counted_not_fatal(tmp_path):
    run = data.RunFolder(write_run(tmp_path / "run", torn=True))
    curves = run.curves()
    assert curves["step"] == [1, 2, 3] and curves["reward"] == [0.1, 0.2, 0.3]
    assert curves["bad_lines"]["metrics.jsonl"] == 1
    assert curves["eval"]["pass@1"] == [0.25] and curves["eval"]["k"] == "pass@4"
    assert curves["staleness"] == {"step": [1, 2, 3], "levels": [0, 1], "counts": [[1, 1, 1], [1, 1, 1]]}


def test_a_run_still_starting_or_missing_says_what_is_missing(tmp_path):
    (tmp_path / "starting").mkdir()
    starting = data.RunFolder(tmp_path / "starting").overview()
    assert starting["exists"] and not starting["ended"]
    assert "metrics.jsonl" in starting["missing"] and "still starting" in starting["notes"][0]
    assert data.RunFolder(tmp_path / "nope").overview() == {
        "run_dir": str((tmp_path / "nope").resolve()),
        "exists": False,
        "missing": {},
        "notes": ["no such folder"],
    }
    older = data.RunFolder(write_run(tmp_path / "older")).overview()  # before rollouts were kept
    assert list(older["missing"]) == ["summary.json", "dropped.jsonl", "rollouts.jsonl"]


def test_no_path_outside_the_run_folder_is_read(tmp_path):
    run = data.RunFolder(write_run(tmp_path / "run"))
    (tmp_path / "secret.jsonl").write_text('{"a": 1}\n')
    for name in ("../secret.jsonl", "/etc/passwd", "eval/../../secret.jsonl"):
        with pytest.raises(ValueError, match="outside the run folder"):
            run.jsonl(name)
    client = TestClient(make_app(tmp_path / "run"), base_url="http://127.0.0.1")
    for path in ("/api/rollout/..%2F..%2Fsecret", "/api/eval/..%2Fsecret", "/static/..%2F..%2Fdata.py"):
        response = client.get(path)
        assert response.status_code in (404, 422) and "secret" not in response.text


def test_the_api_answers_with_reasons_never_stack_traces(tmp_path):
    client = TestClient(make_app(write_run(tmp_path / "run")), base_url="http://127.0.0.1")
    assert client.get("/api/curves").json()["reward"] == [0.1, 0.2, 0.3]
    missing = client.get("/api/rollout/g1-0")
    assert missing.status_code == 404 and missing.json() == {"error": "no kept rollout 'g1-0'"}
    assert client.get("/api/rollouts?step=x").status_code == 422  # a step that is no number
    page = client.get("/")
    assert page.status_code == 200 and "plotly.min.js" in page.text
    assert client.get("/static/plotly.min.js").headers["content-type"].startswith("text/javascript")


def test_a_token_guards_every_request_and_is_required_beyond_loopback(tmp_path):
    check_bind("127.0.0.1", None)
    with pytest.raises(ValueError, match="--host 0.0.0.0: a viewer that listens beyond loopback needs --token-file"):
        check_bind("0.0.0.0", None)
    client = TestClient(make_app(write_run(tmp_path / "run"), token="s3cret"), base_url="http://127.0.0.1")
    assert client.get("/api/curves").status_code == 401
    assert client.get("/api/curves?token=wrong").status_code == 401
    assert client.get("/?token=s3cret").status_code == 200
    assert client.get("/api/curves").status_code == 200  # the cookie it set


def rollouts(count: int, group_size: int = 4) -> list:
    from asyncrl.wire.protocol import Rollout

    return [
        Rollout(
            rollout_id=f"r{i}",
            group_id=f"g{i // group_size}",
            group_size=group_size,
            prompt_index=i // group_size,
            prompt_ids=[1, 2],
            response_ids=[5, 6, 7],
            logprobs=[-0.5, -0.25, -0.125],
            versions=[3, 3, 4],
            reward=i / 16,
            finish_reason="stop",
            generator_id="gen-0",
            created_s=0.0,
        )
        for i in range(count)
    ]


def test_the_learner_keeps_a_bounded_sample_of_each_step_spread_over_its_groups(tmp_path):
    assert spread(4, 16) == [0, 4, 8, 12] and spread(4, 3) == [0, 1, 2]
    batch = rollouts(16)
    sampler = RolloutSampler(tmp_path, per_step=4, max_mb=0.002)  # room for one step's sample
    sampler.write(7, 5, batch, [1] * 16, [[0.5, 0.5, 0.5]] * 16)
    sampler.write(8, 6, batch, [1] * 16, [[0.5, 0.5, 0.5]] * 16)  # over the cap: not written
    kept = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in kept] == ["r0", "r4", "r8", "r12"]  # one of each group
    assert kept[1]["versions"] == [3, 3, 4] and kept[1]["advantages"] == [0.5, 0.5, 0.5]
    assert kept[1]["loss_mask"] == [1, 1, 1] and {r["step"] for r in kept} == {7}


def test_a_held_out_prompts_answers_at_every_evaluated_version_side_by_side(tmp_path):
    root = write_run(tmp_path / "run")
    (root / "eval").mkdir()
    for version, reward in ((0, 0.0), (20, 1.0)):
        traces = [
            {
                "index": i,
                "prompt": f"q{i}",
                "response": f"a{i}v{version}",
                "answer": str(i),
                "reward": reward,
                "version": version,
                "greedy": greedy,
            }
            for i in (3, 4)
            for greedy in (True, False, False)
        ]
        (root / "eval" / f"v{version:06d}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    item = TestClient(make_app(root), base_url="http://127.0.0.1").get("/api/eval_item/4").json()
    assert [v["version"] for v in item["versions"]] == [0, 20]
    assert [[t["reward"] for t in v["traces"]] for v in item["versions"]] == [[0.0] * 3, [1.0] * 3]
    assert {t["index"] for v in item["versions"] for t in v["traces"]} == {4}


def test_the_pipeline_of_a_running_run_is_the_learners_live_snapshot(tmp_path, tcp_address):
    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.server import CoordinatorServer
    from asyncrl.control.staleness import StalenessBound
    from asyncrl.wire.protocol import GeneratorStatus, Status

    root = write_run(tmp_path / "run")
    (root / "config.yaml").write_text(f"name: tiny\ncoordinator:\n  address: {tcp_address}\n")
    run = data.RunFolder(root)
    assert run.pipeline()["live"] is None  # nobody answers: still starting, or stopped
    status = Status(
        step=3,
        total_steps=10,
        version=3,
        max_staleness=1,
        samples_consumed=48,
        samples_dropped={},
        samples_admitted=64,
        buffer={"waiting": 8.0},
        generator_lease_s=60.0,
        started_s=100.0,
        now_s=110.0,
        generators=[
            GeneratorStatus(generator_id="gen-0", weight_version=3, samples_generated=64, busy_s=5.0, last_seen_s=109.0)
        ],
    )
    coordinator = Coordinator(StalenessBound(1, 16), PromptCursor(10, 0), group_size=8, lease_s=60)
    server = CoordinatorServer(coordinator, tcp_address, lambda: status)
    try:
        live = run.pipeline()["live"]
    finally:
        server.close()
    assert live["step"] == 3 and live["in_flight"] == 16 and live["buffer"] == {"waiting": 8.0}
    assert [(g["generator_id"], g["state"], g["seen_s_ago"]) for g in live["generators"]] == [("gen-0", "alive", 1.0)]
    (root / "config.yaml").write_text(f"name: tiny\ncoordinator:\n  address: {tcp_address}\n  run_id: ours\n")
    other = msgspec.structs.replace(status, run_id="theirs")  # our run died; another took its address
    server = CoordinatorServer(coordinator, tcp_address, lambda: other)
    try:
        assert run.pipeline()["live"] is None
    finally:
        server.close()
    (root / "summary.json").write_text("{}")
    assert run.pipeline()["live"] is None  # ended: its totals, not a live view


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["configs/quickstart.yaml", "--ray", "--view", "8765"], "--view serves one local run"),
        (["configs/quickstart.yaml", "--compare-sync", "--view", "8765"], "--view serves one local run"),
    ],
)
def test_asyncrl_run_view_refuses_what_it_cannot_serve_before_anything_starts(argv, says, capsys):
    from asyncrl.launch.cli import main

    assert main(["run", *argv]) == 1
    assert says in capsys.readouterr().err


def test_a_growing_file_is_parsed_as_it_grows_and_a_replaced_one_from_its_start(tmp_path):
    folder, path = data.RunFolder(tmp_path), tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2')  # the second line is still being written
    assert folder.jsonl("metrics.jsonl") == ([{"step": 1}], 1)
    with path.open("a") as f:
        f.write(', "reward": 0.5}\n{"step": 3}\n')
    records, bad = folder.jsonl("metrics.jsonl")
    assert (records, bad) == ([{"step": 1}, {"step": 2, "reward": 0.5}, {"step": 3}], 0)
    assert folder.jsonl("metrics.jsonl")[0] == records, "read again, nothing new: the same records"
    path.write_text('{"step": 9}\nnot json\n')  # a new run in the same folder: a shorter file
    assert folder.jsonl("metrics.jsonl") == ([{"step": 9}], 1)
    replaced = tmp_path / "metrics.new"
    replaced.write_text('{"step": 10}\n{"step": 11}\n{"step": 12}\n')
    replaced.replace(path)  # replaced whole, longer than before
    assert [r["step"] for r in folder.jsonl("metrics.jsonl")[0]] == [10, 11, 12]
    path.unlink()
    assert folder.jsonl("metrics.jsonl") == ([], 0)


def test_dropped_rollouts_are_kept_with_their_reason_and_the_browser_filters_on_it(tmp_path):
    batch, dropped = rollouts(4), rollouts(6)[4:]
    sampler = RolloutSampler(tmp_path, per_step=2, max_mb=1)
    sampler.write(7, 6, batch, [2] * 4, None)
    sampler.write_dropped(7, 6, [(dropped[0], "stale"), (dropped[1], "uniform_reward")])
    run = data.RunFolder(tmp_path)
    every = run.rollouts()
    assert [(r["id"], r["drop_reason"]) for r in every["rows"]] == [
        ("r0", None),
        ("r2", None),
        ("r4", "stale"),
        ("r5", "uniform_reward"),
    ]
    assert every["drop_reasons"] == ["stale", "uniform_reward"]
    assert [r["id"] for r in run.rollouts(kept="trained")["rows"]] == ["r0", "r2"]
    stale = run.rollouts(kept="stale")["rows"]
    assert [r["id"] for r in stale] == ["r4"] and stale[0]["staleness"] == 6 - 3  # sampled from version 3
    assert run.rollout("r4")["drop_reason"] == "stale" and run.rollout("r4")["consumed"] is None
    assert [r["id"] for r in run.rollouts(prompt=1)["rows"]] == ["r4", "r5"]  # one prompt's group, both kinds


def test_samples_per_second_generated_and_trained_are_measured_over_the_last_steps():
    steps = [{"step": s, "wall_s": s * 0.5, "samples": 8, "generated_samples": 12 * s} for s in range(1, 13)]
    for step in steps[5:]:  # the learner resumed at step 6: its count of generated samples starts again
        step["generated_samples"] = 12 * (step["step"] - 5)
    rates = data._rates(steps, window=4)
    assert rates["trained"][0] is None and rates["trained"][4] == 32 / 2.0  # 4 steps of 8 samples in 2 s
    assert rates["generated"][4] == 48 / 2.0
    assert rates["generated"][5] is None and rates["generated"][7] is None  # across the restart: no rate
    assert rates["generated"][9] == 48 / 2.0  # the window after it
    assert data._rates([{"step": 1, "wall_s": 1.0, "samples": 8}] * 3, window=2)["generated"] == [None] * 3


def test_several_runs_on_one_page_each_by_its_index(tmp_path, monkeypatch):
    first, second = write_run(tmp_path / "a" / "seed0", steps=2), write_run(tmp_path / "b" / "seed0", steps=5)
    client = TestClient(make_app([first, second]), base_url="http://127.0.0.1")
    assert [r["name"] for r in client.get("/api/runs").json()] == ["a/seed0", "b/seed0"]
    assert client.get("/api/curves").json()["step"] == [1, 2], "run 0 unless the page asks for another"
    assert client.get("/api/curves?run=1").json()["step"] == [1, 2, 3, 4, 5]
    missing = client.get("/api/overview?run=2")
    assert missing.status_code == 404 and missing.json() == {"error": "no run 2: this viewer serves runs 0 to 1"}

    # asyncrl run A.yaml B.yaml --view PORT: one viewer for both runs' folders
    from asyncrl.launch import cli, local, viewer

    served, ran = [], []
    monkeypatch.setattr(viewer, "start_for_run", lambda dirs, port: served.append((dirs, port)))
    monkeypatch.setattr(local, "run_shared", lambda configs, *rest: ran.append(configs) or [])
    configs = ["configs/digits-copy-lora-vllm.yaml", "configs/digits-next-lora-vllm.yaml"]
    assert cli.main(["run", *configs, "--view", "8790"]) == 0
    assert ran == [configs]
    assert served == [([cli.load_config(c, []).run_dir for c in configs], 8790)]
    assert len(set(served[0][0])) == 2


def test_the_last_weight_update_says_how_versions_travel(tmp_path):
    root = write_run(tmp_path / "run")
    config = (root / "config.yaml").read_text()
    (root / "config.yaml").unlink()
    folder = data.RunFolder(root)
    assert folder.transport() is None, "a run still starting: not yet known"
    (root / "config.yaml").write_text(config)
    assert folder.transport() == "folder", "known once the run has written its config"
    weights = data.RunFolder(root).pipeline()["weights"]
    assert weights["transport"] == "folder" and weights["version"] is None and weights["at_step"] == 3
    (root / "config.yaml").write_text("name: tiny\ncoordinator:\n  weights_address: tcp://127.0.0.1:5557\n")
    assert data.RunFolder(root).pipeline()["weights"]["transport"] == "served"
    (root / "config.yaml").write_text("name: tiny\nlearner:\n  no_such_key: 1\n")  # an asyncrl to come, or damage
    assert data.RunFolder(root).pipeline()["weights"]["transport"] is None


def test_a_file_cut_back_in_place_and_grown_past_what_was_read_is_read_again_from_its_start(tmp_path):
    """A resumed run cuts its logs back to the checkpoint's step in the same file, then appends: between two reads
    the file may grow past the offset already parsed."""
    from asyncrl.launch.viewer.tail import Tail, read_at

    path, tail = tmp_path / "consumed.jsonl", Tail()
    path.write_text("".join(json.dumps({"id": f"a{i}", "step": 1}) + "\n" for i in range(3)))
    assert [r["id"] for r in tail.read(path)[0]] == ["a0", "a1", "a2"]
    inode = path.stat().st_ino
    with path.open("r+") as f:  # the same file, rewritten: one line kept, then more than before
        f.truncate(0)
        f.write("".join(json.dumps({"id": f"b{i}", "step": 2}) + "\n" for i in range(6)))
    assert path.stat().st_ino == inode
    assert [r["id"] for r in tail.read(path)[0]] == [f"b{i}" for i in range(6)]
    offsets = Tail(lambda record, offset: offset).read(path)[0]
    assert read_at(path, offsets[4]) == {"id": "b4", "step": 2}
    counted = Tail(lambda record, offset: record["step"], tally=True).read(path)[0]
    assert counted == {2: 6}


def test_the_rollout_list_holds_no_tokens_and_a_duplicate_opens_as_itself(tmp_path):
    batch = rollouts(2)
    sampler = RolloutSampler(tmp_path, per_step=2, max_mb=1)
    sampler.write(7, 6, batch, [1, 1], None)
    sampler.write_dropped(8, 7, [(batch[0], "duplicate")])  # a copy that arrived again: the same id
    run = data.RunFolder(tmp_path)
    rows = run.rollouts()["rows"]
    assert [(r["id"], r["drop_reason"]) for r in rows] == [("r0", None), ("r1", None), ("r0", "duplicate")]
    assert "response_ids" not in rows[0] and rows[0]["tokens"] == 3
    assert run.rollout("r0", rows[2]["at"])["drop_reason"] == "duplicate"
    assert run.rollout("r0", rows[0]["at"])["drop_reason"] is None
    assert run.rollout("r0", rows[1]["at"]) is None, "the row at that offset is another rollout's"


def test_the_dropped_rollouts_kept_are_a_uniform_sample_of_a_steps_drops_in_bounded_memory():
    from learners.rollout_sample import DropSample

    drops = rollouts(1000, group_size=1)
    sample = DropSample(4)
    for i, rollout in enumerate(drops):
        sample.add(rollout, "orphaned" if i < 900 else "stale")
    kept = sample.take()
    assert len(kept) == 4 and sample.take() == [], "taken: the next step's sample starts empty"
    # a burst of drops at the end does not crowd the earlier reasons out: the draw is over all 1000
    positions = [int(rollout.rollout_id[1:]) for rollout, _ in kept]
    assert min(positions) < 900, positions
    firsts = []
    for seed in range(200):
        sample = DropSample(1, seed=seed)
        for rollout in drops:
            sample.add(rollout, "stale")
        firsts.append(int(sample.take()[0][0].rollout_id[1:]))
    assert 400 < sum(firsts) / len(firsts) < 600  # uniform over 0..999: mean 499.5
    off = DropSample(0)
    off.add(drops[0], "stale")
    assert off.take() == []


def test_a_loopback_viewer_answers_only_requests_that_name_a_loopback_host(tmp_path):
    """A web page whose name was rebound to 127.0.0.1 (DNS rebinding) reaches the viewer with its own host name:
    refused, so the page cannot read the run through the user's browser."""
    client = TestClient(make_app(write_run(tmp_path / "run")), base_url="http://127.0.0.1")
    assert client.get("/api/runs").status_code == 200
    for host in ("localhost:8765", "[::1]:8765", "127.0.0.1"):
        assert client.get("/api/runs", headers={"host": host}).status_code == 200, host
    refused = client.get("/api/runs", headers={"host": "evil.example:8765"})
    assert refused.status_code == 421 and "evil.example" in refused.json()["error"]


def test_evaluations_are_drawn_in_step_order_with_the_start_at_0_s(tmp_path):
    run = write_run(tmp_path / "run")
    records = [{"step": s, "version": s, "pass@1": s / 10, "pass@4": s / 5} for s in (0, 2, 1)]  # finish order
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = data.RunFolder(run).curves()["eval"]
    assert curves["step"] == [0, 1, 2] and curves["pass@1"] == [0.0, 0.1, 0.2]
    assert curves["wall_s"] == [0.0, 0.5, 1.0]


def test_a_kept_rollout_with_a_nan_log_prob_is_written_as_json_and_opens(tmp_path):
    """A diverged learner's log-probs are the ones to look at: written as null (NaN is not JSON), and shown."""
    from conftest import make_rollout

    run = write_run(tmp_path / "run")
    sampler, kept = RolloutSampler(run, per_step=1, max_mb=1.0), make_rollout(0, n_tokens=2)
    sampler.write(1, 0, [kept], [0], None, {kept.rollout_id: [float("nan"), -0.5]})
    line = (run / "rollouts.jsonl").read_text()
    assert "NaN" not in line and json.loads(line)["learner_logprobs"] == [None, -0.5]
    rollout_id = json.loads(line)["id"]
    answer = TestClient(make_app(run), base_url="http://127.0.0.1").get(f"/api/rollout/{rollout_id}")
    assert answer.status_code == 200, answer.text
    assert [t["learner_logprob"] for t in answer.json()["tokens"]] == [None, -0.5]


def test_a_fresh_run_in_an_old_folder_keeps_none_of_the_earlier_runs_rollouts(tmp_path):
    from asyncrl.run_folder import take_folder

    run = write_run(tmp_path / "run")
    (run / "rollouts.jsonl").write_text('{"step": 1}\n')
    take_folder(run, resume=False)
    assert not (run / "rollouts.jsonl").exists() and not (run / "metrics.jsonl").exists()
