"""``asyncrl plan``: the simulation's invariants, reading a run folder, and the command end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from asyncrl.launch.cli import main
from asyncrl.launch.plan.model import Lengths, Pipeline, simulate
from asyncrl.launch.plan.rates import RunFolderError, read_run
from asyncrl.launch.plan.search import Cluster, Rates, groups_per_step_choices, on_split, search

FIXED = Lengths.histogram({4: 1})


def pipe(**changes) -> Pipeline:
    """One batch generator and a learner, 8 x 16 samples per step, every response 4 tokens."""
    base = Pipeline(
        generators=1,
        generator_samples_per_s=100.0,
        learner_samples_per_s=100.0,
        max_staleness=1,
        group_size=8,
        groups_per_step=16,
        groups_per_request=16,
        lengths=FIXED,
    )
    return replace(base, **changes)


def test_synchronous_bound_alternates_the_two_sides() -> None:
    # With max_staleness 0 a step waits for its batch and the next batch for the step's weights, so a step
    # takes Tg + Tt and the efficiency over the slower side is max(Tg, Tt) / (Tg + Tt).
    tg, tt = 128 / 100.0, 128 / 300.0
    out = simulate(pipe(max_staleness=0, learner_samples_per_s=300.0), steps=100)
    assert out.histogram(0) == [1.0]
    assert out.pipeline_efficiency == pytest.approx(max(tg, tt) / (tg + tt), rel=0.01)
    assert out.samples_dropped == 0


def test_fast_generator_keeps_the_learner_busy_at_the_bound() -> None:
    out = simulate(pipe(generator_samples_per_s=1000.0, max_staleness=2), steps=200)
    assert out.pipeline_efficiency > 0.97
    assert out.staleness[2] > 0.95  # admitted as far ahead as the bound lets it


def test_generators_add_up_while_they_are_the_bottleneck() -> None:
    slow = pipe(generator_samples_per_s=50.0, learner_samples_per_s=1000.0, max_staleness=2)
    one = simulate(slow, steps=200).achieved_samples_per_s
    two = simulate(replace(slow, generators=2), steps=200).achieved_samples_per_s
    assert 1.8 < two / one < 2.05


def test_learner_overhead_and_update_pauses_cost_throughput() -> None:
    free = simulate(pipe(generator_samples_per_s=1000.0), steps=100).achieved_samples_per_s
    held = simulate(pipe(generator_samples_per_s=1000.0, learner_overhead_s=0.64), steps=100)
    assert held.achieved_samples_per_s == pytest.approx(free / 1.5, rel=0.02)  # 1.28 s steps + 0.64 s records
    assert held.pipeline_efficiency < 0.7


def test_streaming_engine_with_long_tails_and_a_bound_is_deterministic() -> None:
    long = pipe(streaming=True, lengths=Lengths.lognormal(2000, 16384), generators=3, jitter=(0.5, 1.0, 1.5))
    first, again = simulate(long, steps=80, seed=3), simulate(long, steps=80, seed=3)
    assert first == again
    assert max(first.staleness) <= long.max_staleness
    assert simulate(long, steps=80, seed=4) != first


def test_lognormal_lengths_are_cut_at_the_max() -> None:
    lengths = Lengths.lognormal(3000, 4096)
    import numpy as np

    drawn = lengths.draw(np.random.default_rng(0), 5000)
    assert drawn.max() == 4096 and drawn.min() >= 1
    assert 2300 < lengths.mean() < 3000  # truncation takes from the mean
    with pytest.raises(ValueError, match="at most the max length"):
        Lengths.lognormal(5000, 4096)


def test_length_phases_play_each_side_at_its_own_pace() -> None:
    # Answers 1.5x the mean, then half: the generator (time with the longest answer) is 1.5x slower than the
    # learner, then twice as fast; the learner's step does not grow with answers here. The run averages the
    # two, so both capacities still read 100/s, but half the steps wait on the generator: efficiency 1/1.25.
    shrinking = pipe(length_scale=(1.5, 0.5), learner_fixed_share=1.0, max_staleness=1)
    out = simulate(shrinking, steps=200)
    assert out.generator_capacity_samples_per_s == pytest.approx(100.0, rel=0.02)
    assert out.pipeline_efficiency == pytest.approx(0.8, abs=0.03)
    assert simulate(replace(shrinking, length_scale=()), steps=200).pipeline_efficiency > 0.97


def test_learner_fixed_share_decides_whether_phases_unbalance_the_sides() -> None:
    # The same phases as above. A learner whose step is all per token slows and speeds up with the answers as
    # the generator does, so neither side waits on the other; one whose step is all fixed (prompts, optimizer)
    # keeps its pace, so the generator holds it back in the long phase.
    phases = pipe(length_scale=(1.5, 0.5), max_staleness=1)
    per_token = simulate(replace(phases, learner_fixed_share=0.0), steps=200)
    fixed = simulate(replace(phases, learner_fixed_share=1.0), steps=200)
    assert per_token.pipeline_efficiency > 0.95 > 0.85 > fixed.pipeline_efficiency
    assert per_token.learner_capacity_samples_per_s == pytest.approx(100.0, rel=0.03)  # averages to the measured


# Synchronous, so every second of evaluation is a second of wall time; a piece is two batches as long as their
# longest answer (1.28 s each: 128 samples at 100/s). An evaluation every 10 steps: 64 prompts, greedy and k=4.
SYNC = pipe(max_staleness=0, learner_samples_per_s=1e6)
EVALUATED = replace(SYNC, eval_every_steps=10, eval_prompts=64, eval_k=4)


def pieces_played(pipeline: Pipeline, steps: int) -> float:
    """The wall time ``pipeline``'s evaluation added to ``steps`` synchronous steps, in pieces."""
    return (simulate(pipeline, steps=steps).wall_s - simulate(SYNC, steps=steps).wall_s) / (2 * 1.28)


def test_an_evaluation_piece_holds_a_request_for_a_greedy_and_a_sampled_batch() -> None:
    # Whole evaluations at versions 10..90 land inside the timed steps (version 0's comes before the first
    # batch, 100's after the last): 9 pieces. In halves, 18 of them and version 0's second, which comes with the
    # second request as in the SmolLM2 run.
    assert pieces_played(EVALUATED, steps=100) == pytest.approx(9, rel=0.01)
    assert pieces_played(replace(EVALUATED, eval_prompts_per_piece=32), steps=100) == pytest.approx(19, rel=0.01)


def test_an_evaluation_budget_keeps_evaluation_to_its_share_of_what_is_generated() -> None:
    # A piece (320 sequences) every 10 steps of 1,280 training samples is a quarter as much again: 99 pieces in
    # 1,000 steps. Under eval.max_share 0.1 a step earns 128 x 0.1 / 0.9 = 14.2 sequences and evaluations not
    # begun give way: 44 pieces after version 0's, which is charged too (45 in all, 14,400 sequences against
    # 128,000, a share of 0.101; the last piece overdraws).
    assert pieces_played(EVALUATED, steps=1000) == pytest.approx(99, rel=0.01)
    assert pieces_played(replace(EVALUATED, eval_max_share=0.1), steps=1000) == pytest.approx(44, rel=0.01)


def test_default_groups_per_step_cover_the_engines_so_a_big_cluster_is_not_capped() -> None:
    base = pipe(streaming=True, groups_in_flight=16, lengths=Lengths.lognormal(100, 400), max_staleness=3)
    assert groups_per_step_choices(base, engines=300, bound=3) == [512, 1024, 2048, 4096]  # 300 x 16 / 4 = 1200
    assert groups_per_step_choices(base, engines=2, bound=3) == [4, 8, 16]
    cluster, rates = Cluster(gpus=48), Rates(1.0, 2.0)
    capped = search(base, cluster, rates, staleness=[1], groups_per_step=[16], steps=40)[0]
    scaled = search(base, cluster, rates, staleness=[1], steps=40)[0]
    engines = on_split(base, cluster, rates, scaled.learner_gpus).generators
    assert 2 * scaled.groups_per_step >= engines * 16  # the window holds what the engines run
    assert capped.prediction.pipeline_efficiency < 0.6 < 0.85 < scaled.prediction.pipeline_efficiency


def test_a_big_cluster_played_shrunk_predicts_what_it_would_at_full_size() -> None:
    from asyncrl.launch.plan import search as plan_search

    big = pipe(streaming=True, groups_in_flight=4, generators=64, groups_per_step=512, group_size=2, max_staleness=1)
    big = replace(big, generator_samples_per_s=10.0, learner_samples_per_s=500.0, lengths=Lengths.lognormal(20, 80))
    small, factor = plan_search._scaled_down(big)
    assert (small.generators, small.groups_per_step, factor) == (32, 256, 2.0)
    full, shrunk = simulate(big, steps=20), plan_search._grown(simulate(small, steps=20), factor)
    assert shrunk.achieved_samples_per_s == pytest.approx(full.achieved_samples_per_s, rel=0.03)
    assert shrunk.pipeline_efficiency == pytest.approx(full.pipeline_efficiency, rel=0.03)


def write_run(folder, summary=None, steps=6, generators=2) -> None:
    """A small run folder as a run leaves it."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = summary or {
        "max_staleness": 1,
        "achieved_samples_per_s": 90.0,
        "pipeline_efficiency": 0.9,
        "generator_capacity_samples_per_s": 200.0,
        "learner_capacity_samples_per_s": 100.0,
        "staleness_by_length": {"1-1": {"fresh": 10, "stale_rate": 0.0}, "4-4": {"fresh": 30, "stale_rate": 0.0}},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    config = (
        f"generator:\n  backend: transformers\n  replicas: {generators}\n  samples_per_prompt: 2\n"
        "  groups_per_request: 2\n  max_new_tokens: 4\n  devices: null\nlearner:\n  groups_per_step: 2\n"
        "  devices: null\neval:\n  every_steps: 0\n"
    )
    (folder / "config.yaml").write_text(config)
    metrics = [
        {
            "step": s,
            "samples": 4,
            "tokens": 12,
            "response_len": 3.0,
            "staleness_mean": 0.5 if s > 1 else 0.0,
            "step_s": 0.04,
            "publish_s": 0.0,
            "wait_s": 0.0,
            "wall_s": 0.05 * s,
        }
        for s in range(1, steps + 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    consumed = [{"id": str(i), "step": 1, "staleness": int(i % 4 == 0)} for i in range(8)]
    (folder / "consumed.jsonl").write_text("".join(json.dumps(c) + "\n" for c in consumed))
    (folder / "logs").mkdir(exist_ok=True)
    (folder / "logs" / "generator-0.log").write_text("x gen-0: loaded weights v1 in 0.004s\n")


def test_reads_rates_lengths_and_staleness_from_a_run_folder(tmp_path) -> None:
    write_run(tmp_path)
    measured = read_run(tmp_path)
    p = measured.pipeline
    assert (p.generators, p.generator_samples_per_s, p.learner_samples_per_s) == (2, 100.0, 100.0)
    assert (p.group_size, p.groups_per_step, p.max_staleness, p.streaming) == (2, 2, 1, False)
    assert p.lengths.mean() == pytest.approx(3.25)
    assert p.learner_overhead_s == pytest.approx(0.01)
    assert p.reload_s == 0.004
    assert measured.staleness == {0: 0.75, 1: 0.25}


def test_rates_per_gpu_divide_a_run_over_its_engine_and_learner_devices(tmp_path) -> None:
    from asyncrl.launch.plan.inputs import _rates

    write_run(tmp_path)
    config = (tmp_path / "config.yaml").read_text()
    config = config.replace("backend: transformers", "backend: vllm\n  vllm:\n    tensor_parallel_size: 2")
    (tmp_path / "config.yaml").write_text(config.replace("groups_per_step: 2", "groups_per_step: 2\n  ranks: 4"))
    measured = read_run(tmp_path)
    assert (measured.gpus_per_generator, measured.learner_gpus) == (2, 4)
    args = type("Args", (), {"generator_rate": None, "learner_rate": None})()
    rates = _rates(args, measured)
    assert (rates.generator_samples_per_s, rates.learner_samples_per_s) == (50.0, 25.0)  # 100/2 and 100/4


def test_a_version_every_few_steps_widens_the_bounds_window() -> None:
    # max_staleness 0 with a version every 2 steps: the bound admits two steps' samples per version, so the
    # generator samples the second step's batch while the learner trains on the first
    every_step = simulate(pipe(max_staleness=0), steps=100)
    every_two = simulate(pipe(max_staleness=0, publish_every_steps=2), steps=100)
    assert every_two.achieved_samples_per_s > 1.2 * every_step.achieved_samples_per_s
    assert every_two.histogram(0) == [1.0], "stale by version, not by step"


def test_reads_length_phases_and_the_learners_fixed_share(tmp_path) -> None:
    # Answers shrink from 8 tokens to 2 while a step takes 0.02 s plus 1 ms a token: the run's phases, and a
    # learner whose time is half fixed at the run's mean of 40 tokens a step.
    write_run(tmp_path, steps=8)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m, length in zip(metrics, [8, 8, 8, 8, 2, 2, 2, 2]):
        m.update(response_len=float(length), tokens=4 * length, step_s=0.02 + 0.001 * 4 * length)
        m["wall_s"] = 0.1 * m["step"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    p = read_run(tmp_path).pipeline
    assert p.length_scale == pytest.approx((1.6,) * 4 + (0.4,) * 4)
    assert p.learner_fixed_share == pytest.approx(0.02 / 0.04, rel=0.05)  # at the fitted steps' mean
    assert p.jitter == pytest.approx((1.0,) * 7)


def test_staleness_from_metrics_where_no_consumed_log_was_kept(tmp_path) -> None:
    write_run(tmp_path)
    (tmp_path / "consumed.jsonl").unlink()
    # Step 1 all fresh, then half and half.
    assert read_run(tmp_path).staleness == pytest.approx({0: 14 / 24, 1: 10 / 24})


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "summary.json").unlink(), r"summary.json: missing"),
        (
            lambda f: write_run(f, summary={"max_staleness": 1}),
            r"summary.json: no field 'generator_capacity_samples_per_s'",
        ),
        (lambda f: (f / "config.yaml").write_text("learner: {}\n"), r"config.yaml: no field 'generator'"),
        (lambda f: (f / "metrics.jsonl").write_text("{\n"), r"metrics.jsonl: a line is not JSON"),
    ],
)
def test_a_run_folder_missing_a_field_is_named(tmp_path, damage, message) -> None:
    write_run(tmp_path)
    damage(tmp_path)
    with pytest.raises(RunFolderError, match=message):
        read_run(tmp_path)


def test_cli_plans_a_cluster_from_a_run_folder(tmp_path, capsys) -> None:
    write_run(tmp_path)
    argv = ["plan", "--from", str(tmp_path), "--gpus", "8", "--max-staleness", "0", "2", "--steps", "60"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["learner", "generator", "engines"]
    assert "assumed:" in table and "push (NCCL broadcast, NVLink)" in table
    assert main([*argv, "--json", "--top", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["options"]) == 2
    best = out["options"][0]
    assert best["learner_gpus"] + best["generator_gpus"] == 8 and best["max_staleness"] in (0, 2)
    assert best["samples_per_s"] >= out["options"][1]["samples_per_s"] * 0.99


def test_cli_predicts_the_run_as_it_was_and_refuses_without_rates(tmp_path, capsys) -> None:
    write_run(tmp_path)
    assert main(["plan", "--from", str(tmp_path), "--steps", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline_efficiency"]["measured"] == 0.9 and 0 < out["staleness_total_variation"] <= 1
    assert main(["plan", "--gpus", "8", "--mean-tokens", "100", "--max-tokens", "400"]) == 1
    assert "--generator-rate and --learner-rate" in capsys.readouterr().err
    assert main(["plan", "--from", str(tmp_path / "nowhere")]) == 1
    assert "not a run folder" in capsys.readouterr().err


def test_a_generators_gpus_are_on_one_host_and_a_hosts_leftover_gpus_go_to_the_learner() -> None:
    from asyncrl.launch.plan.search import engines_beside, learner_splits

    two_hosts = Cluster(gpus=8, hosts=2, gpus_per_generator=3)
    # learner 2: host 1 keeps 2 GPUs (no whole engine), host 2 has 4 (one engine): not 6 // 3 = 2 engines
    assert [engines_beside(two_hosts, n) for n in (1, 2, 4, 5, 6)] == [2, 1, 1, 1, 0]
    splits = learner_splits(two_hosts, Rates(1.0, 4.0))
    assert splits == [1, 5]  # 2-4 learner GPUs run the same one engine as 5: the idle ones go to the learner
    assert all(o.generator_gpus == 3 * o.generators for o in search(pipe(), two_hosts, Rates(1, 1), [1]))


@pytest.mark.parametrize(
    "cluster, message",
    [
        (Cluster(gpus=1, gpus_per_generator=2), "--gpus-per-generator 2: one GPU"),
        (Cluster(gpus=16, hosts=4, gpus_per_generator=8), "--gpus-per-generator 8: a generator's GPUs are on one host"),
        (Cluster(gpus=4, gpus_per_generator=4), "4 GPUs leave none for a learner beside a 4-GPU generator"),
    ],
)
def test_a_cluster_no_split_can_use_is_refused_naming_the_setting(cluster, message) -> None:
    with pytest.raises(ValueError, match=message):
        search(pipe(), cluster, Rates(1.0, 1.0), [1])
