"""bench/peer_trl.py: how an asyncrl config maps onto TRL's GRPOConfig, what it accepts, and its step-by-step figure."""

import json
import math
from dataclasses import replace

import pytest
from conftest import ROOT

from bench import peer_trl


def config_of(workload: str, *overrides: str):
    """The workload (with ``overrides`` on asyncrl's side) and its config, as the benchmark resolves them."""
    chosen = peer_trl.WORKLOADS[workload]
    if chosen.dtype == "bfloat16":  # what dtype auto resolves to on the GPU the workload runs on
        overrides = ("--model.dtype=bfloat16", *overrides)
    chosen = replace(chosen, overrides=chosen.overrides + overrides)
    return chosen, peer_trl.load_workload_config(chosen, 0, 10)


@pytest.mark.parametrize("workload", ["cpu", "gpu"])
def test_the_workloads_map_onto_trl_with_the_ratio_against_the_generator(workload):
    chosen, config = config_of(workload)
    peer_trl.check_comparable(chosen, config)
    assert peer_trl.ratio_anchor(config.algo) == "generator"
    settings = peer_trl.trl_settings(chosen, config, 0, 10, "/tmp/x")
    assert settings["loss_type"] == "dapo" and settings["beta"] == 0.0
    assert settings["learning_rate"] == config.learner.lr
    assert settings["per_device_train_batch_size"] == config.samples_per_step


def test_a_band_that_masks_nothing_takes_trls_anchor_the_learners_own_logprobs():
    chosen, config = config_of("gpu", "--algo.off_policy=icepop", "--algo.mask_low=0", "--algo.mask_high=.inf")
    peer_trl.check_comparable(chosen, config)
    assert peer_trl.ratio_anchor(config.algo) == "learner"


@pytest.mark.parametrize(
    "overrides",
    [
        ("--algo.off_policy=tis",),  # a weight TRL (correction off) does not apply
        ("--algo.off_policy=icepop",),  # the default band masks tokens
        ("--algo.off_policy=icepop", "--algo.mask_low=0", "--algo.mask_high=1e6"),  # masks ratios above 1e6
    ],
)
def test_a_correction_trl_has_no_counterpart_for_stops_the_benchmark(overrides):
    chosen, config = config_of("gpu", *overrides)
    assert peer_trl.ratio_anchor(config.algo) is None
    with pytest.raises(SystemExit, match="no off-policy correction"):
        peer_trl.check_comparable(chosen, config)


def test_the_step_figure_draws_what_the_runs_recorded(tmp_path):
    def row(side, lengths):
        curve = [[0.1 * s, s, 0.1 + 0.01 * s] for s in range(1, 31)]
        return {"side": side, "seed": 0, "curve": curve, "response_len": lengths, "grad_norm": []}

    rows = [row("trl", [40.0] * 30), row("asyncrl", [None] * 10 + [30.0] * 20)]
    series = peer_trl.step_series(rows, steps=25)
    assert [(side, at[0], len(values)) for side, _, at, values in series["reward"]] == [
        ("trl", 1, 25),
        ("asyncrl", 1, 25),
    ]
    lengths = {side: values for side, _, _, values in series["response_len"]}
    assert lengths["trl"][:3] == [40.0] * 3 and lengths["asyncrl"][10] == 30.0
    assert math.isnan(lengths["asyncrl"][0])  # a step without the figure is a gap, not a zero
    assert series["grad_norm"] == []  # recorded by neither run: an empty panel that says so
    path = tmp_path / "steps.png"
    peer_trl.plot_steps(peer_trl.WORKLOADS["cpu"], rows, path, steps=25)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_setting_the_label_names_takes_its_place_and_the_others_follow():
    """An on-policy run's figure must not say max_staleness=2, whether drawn by the run or by a rescore."""
    workload = peer_trl.with_settings(
        peer_trl.WORKLOADS["gpu"], ["staleness.max_staleness=0", "learner.liger_kernels=false"]
    )
    label = workload.labels["asyncrl"]
    assert "(max_staleness=0) [learner.liger_kernels=false]" in label and "max_staleness=2" not in label
    assert workload.overrides[-2:] == ("--staleness.max_staleness=0", "--learner.liger_kernels=false")
    assert workload.labels["trl"] == peer_trl.WORKLOADS["gpu"].labels["trl"]
    assert peer_trl.with_settings(peer_trl.WORKLOADS["gpu"], []) is peer_trl.WORKLOADS["gpu"]


def test_trl_settings_change_trls_side_only_and_reach_its_grpo_config():
    """--trl-set turns TRL's own options on (its vLLM importance sampling, say) without touching asyncrl's side."""
    base = peer_trl.WORKLOADS["gpu"]
    settings = ["vllm_importance_sampling_correction=true", "vllm_importance_sampling_mode=token_truncate"]
    workload = peer_trl.with_trl_settings(base, settings)
    assert workload.labels["trl"].endswith(
        "[vllm_importance_sampling_correction=true, vllm_importance_sampling_mode=token_truncate]"
    )
    assert workload.labels["asyncrl"] == base.labels["asyncrl"] and workload.overrides == base.overrides
    _, config = config_of("gpu")
    grpo = peer_trl.trl_settings(workload, config, 0, 10, "/tmp/x")
    assert grpo["vllm_importance_sampling_correction"] is True
    assert grpo["vllm_importance_sampling_mode"] == "token_truncate"
    assert peer_trl.trl_settings(base, config, 0, 10, "/tmp/x")["vllm_importance_sampling_correction"] is False
    with pytest.raises(SystemExit, match="--trl-set 'vllm_importance_sampling_correction': expected KEY=VALUE"):
        peer_trl.with_trl_settings(base, ["vllm_importance_sampling_correction"])


def test_a_run_of_other_than_the_workloads_steps_records_another_case():
    """40 steps where the workload runs 110: its records must not take the place of the 110-step ones."""
    from bench.records import Stamp

    result = json.loads((ROOT / "bench/results/peer_trl_gpu_onpolicy_seeds23_h100.json").read_text())
    at = Stamp(commit="abc1234", date="2026-12-06", machine="test")
    assert result["steps"] == 40 and peer_trl.WORKLOADS["gpu"].steps == 110
    cases = {r.case for r in peer_trl.records_of(result, at)}
    assert cases == {"gpu: arith-smollm2 [staleness.max_staleness=0] [learner.rollout_samples_per_step=128] [40 steps]"}
    assert peer_trl.steps_named({**result, "steps": 110}) == "" and peer_trl.steps_named({"steps": None}) == ""


def test_trls_reward_keeps_every_scored_completion_beside_its_step(tmp_path):
    """TRL's side keeps its samples as asyncrl's rollouts.jsonl does, to compare what each side trains on."""
    from types import SimpleNamespace

    _, config = config_of("gpu")
    samples = tmp_path / "completions.jsonl"
    reward = peer_trl.make_reward(config, samples)
    items = [json.dumps({"label": "5"}), json.dumps({"label": "7"})]
    completions = [[{"role": "assistant", "content": "3 + 2 = 5"}], [{"role": "assistant", "content": "I think 9"}]]
    state = SimpleNamespace(global_step=3)
    assert reward([], completions, items, completion_ids=[[1, 2, 3], [4, 5]], trainer_state=state) == [1.0, 0.0]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["step"], r["label"], r["reward"], r["tokens"]) for r in rows] == [(4, "5", 1.0, 3), (4, "7", 0.0, 2)]
    assert rows[1]["text"] == "I think 9"
