"""The algo section applied to a step: shaped rewards, per-token advantages, the loss settings."""

import math

import pytest
import torch
from conftest import asyncrl_run, make_rollout

from asyncrl.config import AlgoConfig, ConfigError, load_config
from learners.algo import loss_config, overlong_penalty, step_advantages


def test_overlong_penalty_ramps_down_over_the_buffer():
    # DAPO eq. 13 with L_max = 100, L_cache = 20: 0 up to 80 tokens, then (80 - L) / 20, -1 at 100.
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == -0.5
    assert overlong_penalty(100, 100, 20, 0.5) == -0.5  # scaled by overlong_penalty
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # off


def test_grpo_advantages_come_out_per_token():
    batch = [make_rollout(0, group="g", reward=1.0, n_tokens=3), make_rollout(1, group="g", reward=0.0, n_tokens=5)]
    adv = step_advantages(batch, AlgoConfig(), max_new_tokens=8)
    # mean 0.5, sample std sqrt(0.5): +-0.5 / (0.70711 + 1e-4)
    expected = 0.5 / (0.5**0.5 + 1e-4)
    assert [a.shape[0] for a in adv] == [3, 5]
    assert torch.allclose(adv[0], torch.full((3,), expected)) and torch.allclose(adv[1], torch.full((5,), -expected))


def test_the_overlong_penalty_enters_the_advantages():
    # Both rewards 1.0, but the 8-token response (at max_new_tokens) pays -1 over a 4-token buffer: 1 vs 0.
    batch = [make_rollout(0, group="g", reward=1.0, n_tokens=3), make_rollout(1, group="g", reward=1.0, n_tokens=8)]
    plain = step_advantages(batch, AlgoConfig(advantage="dr_grpo"), max_new_tokens=8)
    assert all(float(a.abs().max()) == 0.0 for a in plain)
    shaped = step_advantages(batch, AlgoConfig(advantage="dr_grpo", overlong_buffer=4), max_new_tokens=8)
    assert torch.allclose(shaped[0], torch.full((3,), 0.5)) and torch.allclose(shaped[1], torch.full((8,), -0.5))


def test_reinforce_pp_advantages_are_whitened_over_the_batch_tokens():
    batch = [make_rollout(0, group="g", reward=1.0, n_tokens=1), make_rollout(1, group="h", reward=0.0, n_tokens=3)]
    adv = step_advantages(batch, AlgoConfig(advantage="reinforce_pp"), max_new_tokens=8)
    # Token returns (1 | 0, 0, 0): mean 0.25, population std sqrt(0.1875) = 0.43301.
    assert torch.allclose(torch.cat(adv), (torch.tensor([1.0, 0, 0, 0]) - 0.25) / (0.1875**0.5 + 1e-8), atol=1e-5)


def test_loss_config_follows_the_algo_section():
    cfg = loss_config(
        AlgoConfig(
            clip_eps=0.1,
            clip_eps_high=0.28,
            dual_clip=3.0,
            loss_agg="seq-mean-token-mean",
            off_policy="icepop",
            mask_low=0.4,
            mask_high=4.0,
            kl_estimator="k2",
        )
    )
    assert (cfg.eps_low, cfg.clip_high, cfg.dual_clip, cfg.agg) == (0.1, 0.28, 3.0, "seq-mean-token-mean")
    assert (cfg.off_policy, cfg.band_low, cfg.band_high, cfg.kl_estimator) == ("icepop", 0.4, 4.0, "k2")


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.dual_clip=1.1", "algo.dual_clip"),  # must exceed 1 + clip_eps
        ("algo.mask_low=6", "algo.mask_low"),  # above mask_high (5)
        ("algo.advantage=ppo", "algo.advantage"),
        ("learner.kl_coef=0.1", "learner.kl_coef` is now `algo.kl_coef"),
        ("staleness.on_exceed=correct", "staleness.on_exceed"),  # needs algo.off_policy
        ("algo.kl_in=reward", "algo.kl_in"),  # needs kl_coef
        ("task.eval_fraction=0.1", "task.eval_fraction"),  # the default prompts hook has no held-out split
        ("algo.advantage=reinforce_pp --algo.reward_scaling=batch", "algo.reward_scaling"),
        ("algo.kl_coef=0.01 --algo.kl_estimator=k1", "algo.kl_estimator.*gradient of 0"),  # fine in the reward
        (
            "algo.advantage=reinforce_pp --algo.dynamic_sampling=true --generator.samples_per_prompt=1",
            "algo.dynamic_sampling.*samples_per_prompt >= 2",
        ),
        ("algo.clip_eps_high=2.5", "algo.dual_clip"),  # the default c of 3 must exceed 1 + clip_eps_high
        ("learner.mini_batches=9", "learner.mini_batches.*whole groups"),  # above groups_per_step (8)
        ("learner.epochs=0", "learner.epochs"),
    ],
)
def test_bad_algo_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, override.split(" "))


RUNS = {
    # DAPO-style: RLOO, clip-higher, dynamic sampling, TIS for the generator/learner mismatch.
    "rloo-tis-dynamic": [
        "--algo.advantage=rloo",
        "--algo.off_policy=tis",
        "--algo.dynamic_sampling=true",
        "--algo.loss_agg=seq-mean-token-mean",
        "--algo.clip_eps_high=0.28",
        "--algo.entropy_coef=0.001",
    ],
    # A narrow sequence mask (so it acts on this short run), Dr. GRPO, and a k2 KL to the start.
    "drgrpo-seqmask-kl": [
        "--algo.advantage=dr_grpo",
        "--algo.off_policy=seq_mask",
        "--algo.mask_low=0.9",
        "--algo.mask_high=1.1",
        "--algo.kl_coef=0.01",
        "--algo.kl_estimator=k2",
    ],
    # PPO with a critic and GAE as PPO is run: two mini-batches of whole groups and two passes a step (four
    # updates of the policy and of the critic), on packed rows under varlen (each rollout through sdpa on a
    # CPU), the critic's value pass included.
    "ppo-gae": [
        "--algo.advantage=gae",
        "--algo.critic_lr=1e-3",
        "--algo.lam=1.0",
        "--learner.mini_batches=2",
        "--learner.epochs=2",
        "--learner.pack_sequences=true",
        "--learner.attn_implementation=varlen",
    ],
    # LoRA with all of it: the policy's adapter, the critic's own adapter and value head, the KL to the base (the
    # policy with its adapter off), packed rows under varlen, vLLM serving each version's adapter.
    "lora-ppo-gae-kl": [
        "--learner.lora.rank=8",
        "--learner.lora.alpha=16",
        "--learner.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
        "--learner.lr=3e-3",
        "--algo.advantage=gae",
        "--algo.critic_lr=1e-3",
        "--algo.lam=1.0",
        "--algo.kl_coef=0.01",
        "--learner.pack_sequences=true",
        "--learner.attn_implementation=varlen",
    ],
    # REINFORCE++ with its KL penalty folded into the token returns, on padded rows under varlen (the policy's
    # and the reference's passes alike), decoupled PPO over two mini-batches a step, their ratio against the
    # proximal log-probs of a pass before the step.
    "reinforcepp-kl-reward": [
        "--algo.advantage=reinforce_pp",
        "--algo.kl_coef=0.01",
        "--algo.kl_in=reward",
        "--algo.off_policy=decoupled",
        "--learner.mini_batches=2",
        "--learner.attn_implementation=varlen",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_run_learns_with_other_estimators_and_corrections(tmp_path, name):
    import json

    run_dir = tmp_path / name
    # The estimators and corrections are the learner's: the transformers backend starts seconds sooner than
    # vLLM's engine on a CPU and gives behaviour log-probs the same way (runs through vLLM: test_integration).
    backend = "--generator.backend=transformers"
    out = asyncrl_run("configs/ci-tiny.yaml", run_dir, "--learner.total_steps=60", backend, *RUNS[name], timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # measured: 0.08 -> 0.21 and 0.06 -> 0.19 in 60 steps (the default GRPO run: 0.06 -> 0.24); the narrow
    # sequence mask's run, which trains on fewer sequences, also 0.06 -> 0.14 (its steps went 0.05-0.08 for the
    # first 11, 0.16-0.21 near the end, then dipped). Each end is a mean of 3 steps, which before any learning
    # lie within about 0.02 of each other: a run that learns nothing does not gain 0.05.
    assert summary["reward_end"] > summary["reward_start"] + 0.05
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m["mismatch_kl"] for m in metrics) > 0 and max(m["is_ratio_max"] for m in metrics) > 1
    assert {m["updates"] for m in metrics} == {"ppo-gae": {4}, "reinforcepp-kl-reward": {2}}.get(name, {1})
    config = (run_dir / "config.yaml").read_text()  # as the learner settled it
    if name in ("ppo-gae", "lora-ppo-gae-kl", "reinforcepp-kl-reward"):
        assert "attn_implementation: varlen" in config
        assert f"pack_sequences: {'false' if name == 'reinforcepp-kl-reward' else 'true'}" in config
    if name == "rloo-tis-dynamic":
        assert summary["samples_dropped"]["uniform_reward"] > 0, "groups with equal rewards were skipped"
    elif name in ("ppo-gae", "lora-ppo-gae-kl"):
        # The critic starts at 0 (zero head) and learns to predict the return: measured 0.18 against a
        # reward of 0.18 over the last 10 steps (its LoRA twin: 0.22 against 0.23).
        value = sum(m["value_mean"] for m in metrics[-10:]) / 10
        reward = sum(m["reward"] for m in metrics[-10:]) / 10
        assert metrics[0]["value_mean"] == 0.0 and value > 0.08 and abs(value - reward) < 0.05
        if name == "lora-ppo-gae-kl":
            assert max(m["kl_ref"] for m in metrics) > 0, "the adapter moved the policy from its base"
            last = sorted((run_dir / "weights").glob("v*"))[-1]
            assert (last / "adapter_model.safetensors").exists() and not (last / "model.safetensors").exists()
    elif name == "reinforcepp-kl-reward":
        assert max(m["kl_ref"] for m in metrics) > 0, "the policy moved away from the reference"
    else:
        assert max(m["masked_fraction"] for m in metrics) > 0 and max(m["kl_ref"] for m in metrics) > 0


def test_rank_shards_interleave_back_into_batch_order():
    from learners.ranks import interleave

    batch = list(range(7))
    world = 3
    assert interleave([batch[r::world] for r in range(world)]) == batch


def _merge_on_rank(rank: int, store_path: str, out) -> None:

    import torch.distributed as dist

    from learners.policy_loss import LossCounts
    from learners.ranks import Ranks

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank, 2, dist.group.WORLD)
        # Each rank's loss is already its share (loss / world size); rank 1 saw more tokens, and the larger ratio.
        totals = {"loss": [0.25, -0.75][rank]}
        counts = LossCounts(tokens=[2.0, 6.0][rank], clipped_tokens=[1.0, 3.0][rank], is_ratio_max=[1.5, 2.5][rank])
        merged = ranks.merge(totals, counts)
        out.put((rank, totals["loss"], merged.clip_fraction, merged.is_ratio_max, merged.tokens))
        dist.barrier()  # neither rank tears the group down while the other is still in a collective
    finally:
        dist.destroy_process_group()


def _on_two_ranks(target, tmp_path) -> list:
    """What ``target(rank, store, queue)`` puts in the queue on each of two gloo ranks, in rank order."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=target, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in ranks:
        p.start()
    results = sorted((out.get(timeout=60) for _ in ranks), key=lambda result: result[0])
    for p in ranks:
        p.join(timeout=30)
    assert all(p.exitcode == 0 for p in ranks)
    return results


def test_a_steps_logged_loss_and_statistics_cover_every_rank_not_rank_0s(tmp_path):
    results = _on_two_ranks(_merge_on_rank, tmp_path)
    for rank, loss, clip_fraction, ratio_max, tokens in results:  # rank 0 alone logged 0.25, 0.5, 1.5
        assert (loss, clip_fraction, ratio_max, tokens) == (-0.5, 4 / 8, 2.5, 8.0), rank


def _gather_on_rank(rank: int, store_path: str, out) -> None:

    import torch.distributed as dist

    from learners.ranks import Ranks

    def pickled(*args, **kwargs):
        raise AssertionError("nothing between ranks is pickled")

    dist.all_gather_object = dist.broadcast_object_list = pickled
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank, 2, dist.group.WORLD)
        batch = [torch.arange(n, dtype=torch.float32) + 10 * n for n in (3, 0, 5, 2, 1)]  # rank 0: 0, 2, 4
        out.put((rank, [v.tolist() for v in ranks.gather_shards(ranks.mine(batch))]))
        dist.barrier()  # neither rank tears the group down while the other is still in a collective
    finally:
        dist.destroy_process_group()


def test_per_token_values_of_every_rank_gather_back_into_batch_order_as_tensors(tmp_path):
    results = dict(_on_two_ranks(_gather_on_rank, tmp_path))
    expected = [(torch.arange(n, dtype=torch.float32) + 10 * n).tolist() for n in (3, 0, 5, 2, 1)]
    assert results[0] == results[1] == expected


def test_kl_in_the_reward_enters_reinforce_pp_returns():
    batch = [make_rollout(0, group="g", reward=1.0, n_tokens=2), make_rollout(1, group="h", reward=1.0, n_tokens=2)]
    algo = AlgoConfig(advantage="reinforce_pp", kl_coef=0.5, kl_in="reward")
    # Returns: rollout 0 pays 0.5 * (0.2 + 0.4) at token 0 and 0.5 * 0.4 at token 1: (0.7, 0.8);
    # rollout 1 pays nothing: (1, 1). Whitened over the 4 tokens (mean 0.875, population std 0.1299).
    kl = [torch.tensor([0.2, 0.4]), torch.zeros(2)]
    adv = torch.cat(step_advantages(batch, algo, max_new_tokens=8, token_kl=kl))
    returns = torch.tensor([0.7, 0.8, 1.0, 1.0])
    assert torch.allclose(adv, (returns - 0.875) / (returns.std(unbiased=False) + 1e-8), atol=1e-5)
    assert loss_config(algo).kl_coef == 0.0, "the KL is in the reward, not also in the loss"


def test_gae_by_hand():
    from learners.advantages import gae

    # r = (0, 0, 1), V = (0.5, 0.6, 0.7), gamma 1, lambda 0.5:
    # deltas (0.6 - 0.5, 0.7 - 0.6, 1 - 0.7) = (0.1, 0.1, 0.3); A2 = 0.3, A1 = 0.1 + 0.5 * 0.3 = 0.25,
    # A0 = 0.1 + 0.5 * 0.25 = 0.225; returns A + V = (0.725, 0.85, 1.0).
    rewards, values = [torch.tensor([0.0, 0.0, 1.0])], [torch.tensor([0.5, 0.6, 0.7])]
    (adv,), (ret,) = gae(rewards, values, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([0.225, 0.25, 0.3])) and torch.allclose(
        ret, torch.tensor([0.725, 0.85, 1.0])
    )
    # gamma 0.9, lambda 1: the returns are the discounted rewards (0.81, 0.9, 1.0), whatever the values.
    (adv,), (ret,) = gae(rewards, values, gamma=0.9, lam=1.0)
    assert torch.allclose(ret, torch.tensor([0.81, 0.9, 1.0])) and torch.allclose(adv, torch.tensor([0.31, 0.3, 0.3]))


def test_clipped_value_loss_by_hand():
    from learners.critic import value_loss

    # Token 0: (1 - 0)^2 = 1 beats the clipped (0.7 - 0)^2 = 0.49; token 1 likewise: 0.5 * (1 + 1) / 2 = 0.5.
    loss = value_loss(
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([[0.5, 0.5]]),
        torch.tensor([[0.0, 1.0]]),
        torch.ones(1, 2),
        clip=0.2,
        num_tokens=2,
    )
    assert abs(loss.item() - 0.5) < 1e-6
    # V = 1.2 from V_old = 0.5 is clipped to 0.7: (0.7 - 1)^2 = 0.09 beats (1.2 - 1)^2 = 0.04: 0.5 * 0.09.
    loss = value_loss(torch.tensor([[1.2]]), torch.tensor([[0.5]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2, 1)
    assert abs(loss.item() - 0.045) < 1e-6
    plain = value_loss(torch.tensor([[1.2]]), torch.tensor([[0.5]]), torch.tensor([[1.0]]), torch.ones(1, 1), None, 1)
    assert abs(plain.item() - 0.02) < 1e-6


def test_gae_targets_put_the_reward_on_the_last_token_and_whiten():
    from learners.algo import gae_targets

    batch = [make_rollout(0, group="g", reward=1.0, n_tokens=2), make_rollout(1, group="g", reward=0.0, n_tokens=2)]
    values = [torch.zeros(2), torch.zeros(2)]
    adv, ret = gae_targets(batch, AlgoConfig(advantage="gae", gamma=1.0, lam=1.0), 8, values)
    # Zero values: returns are the reward at every token, (1, 1) and (0, 0); whitened: +1 and -1.
    assert torch.equal(ret[0], torch.ones(2)) and torch.equal(ret[1], torch.zeros(2))
    assert torch.allclose(torch.cat(adv), torch.tensor([1.0, 1.0, -1.0, -1.0]), atol=1e-6)
    # An episode whose last two tokens are an environment's reply: whitened over the trained tokens only,
    # still +1 and -1 (over every token, 0.58 and -1.73).
    import msgspec

    episode = msgspec.structs.replace(make_rollout(0, reward=1.0, n_tokens=3), loss_mask=[1, 0, 0])
    answer = make_rollout(1, reward=0.0, n_tokens=1)
    adv, _ = gae_targets(
        [episode, answer], AlgoConfig(advantage="gae", gamma=1.0, lam=1.0), 8, [torch.zeros(3), torch.zeros(1)]
    )
    assert torch.allclose(torch.stack([adv[0][0], adv[1][0]]), torch.tensor([1.0, -1.0]), atol=1e-6)


def test_kl_in_the_reward_of_a_group_estimator_is_summed_over_the_response():
    batch = [make_rollout(0, group="g", reward=1.0, n_tokens=2), make_rollout(1, group="g", reward=1.0, n_tokens=2)]
    algo = AlgoConfig(advantage="dr_grpo", kl_coef=0.5, kl_in="reward")
    # Rewards 1 - 0.5 * (0.2 + 0.4) = 0.7 and 1 - 0 = 1: mean 0.85, so Dr. GRPO gives -0.15 and +0.15.
    adv = step_advantages(batch, algo, max_new_tokens=8, token_kl=[torch.tensor([0.2, 0.4]), torch.zeros(2)])
    assert torch.allclose(adv[0], torch.full((2,), -0.15)) and torch.allclose(adv[1], torch.full((2,), 0.15))


def _episode(rollout, loss_mask):
    import msgspec

    return msgspec.structs.replace(rollout, loss_mask=loss_mask)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "reinforce_pp"])
def test_an_episodes_environment_replies_pay_no_kl_penalty(name):
    """The policy did not sample an environment's reply: its tokens' KL to the reference is no penalty."""
    a = _episode(make_rollout(0, group="g", group_size=2, reward=1.0, n_tokens=4), [1, 0, 0, 1])
    b = make_rollout(1, group="g", group_size=2, reward=1.0, n_tokens=4)
    algo = AlgoConfig(advantage=name, kl_coef=1.0, kl_in="reward")
    token_kl = [torch.tensor([0.0, 5.0, 5.0, 0.0]), torch.zeros(4)]  # KL only where a's environment spoke
    advantages = step_advantages([a, b], algo, max_new_tokens=8, token_kl=token_kl)
    # equal rewards, no KL on any sampled token: nothing to learn
    assert all(torch.equal(x, torch.zeros(4)) for x in advantages)


def test_reinforce_pp_whitens_over_the_tokens_it_trains_on():
    """An episode's long environment reply must not weigh in the batch's mean and std (verl and OpenRLHF take
    them over the action mask)."""
    a = _episode(make_rollout(0, group="g0", group_size=1, reward=1.0, n_tokens=10), [1] + [0] * 9)
    b = make_rollout(1, group="g1", group_size=1, reward=0.0, n_tokens=2)
    c = make_rollout(2, group="g2", group_size=1, reward=0.0, n_tokens=1)
    advantages = step_advantages([a, b, c], AlgoConfig(advantage="reinforce_pp"), max_new_tokens=16)
    trained = torch.tensor([1.0, 0.0, 0.0, 0.0])  # the four trained tokens' returns
    expected = (trained - trained.mean()) / trained.var(unbiased=False).sqrt()
    got = torch.stack([advantages[0][0], advantages[1][0], advantages[1][1], advantages[2][0]])
    assert torch.allclose(got, expected, atol=1e-6)  # 1.73 and -0.58; over every token 0.55 and -1.83


def _failed(rollout):
    import msgspec

    return msgspec.structs.replace(rollout, reward=0.0, reward_failed=True)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_a_failed_reward_gets_advantage_0_and_leaves_its_group_as_if_absent(name):
    """A reward that failed is not a 0: counted as one, it would pull its group's mean down and
    reward the others for its failure."""
    scored = [make_rollout(i, group="g", reward=r, n_tokens=2) for i, r in enumerate([1.0, 0.0, 1.0])]
    failed = _failed(make_rollout(3, group="g", reward=0.0, n_tokens=2))
    algo = AlgoConfig(advantage=name)
    with_failure = step_advantages([*scored, failed], algo, max_new_tokens=8)
    without = step_advantages(scored, algo, max_new_tokens=8)
    assert torch.equal(with_failure[3], torch.zeros(2))
    assert all(torch.allclose(a, b) for a, b in zip(with_failure[:3], without))
    as_zero = step_advantages([*scored, make_rollout(3, group="g", reward=0.0, n_tokens=2)], algo, max_new_tokens=8)
    assert not torch.allclose(as_zero[0], without[0]), "a scored 0 does move the group's statistics"


def test_a_failed_reward_teaches_neither_the_policy_nor_the_critic():
    from learners.algo import gae_targets

    batch = [
        make_rollout(0, group="g", reward=1.0, n_tokens=2),
        make_rollout(1, group="g", reward=0.0, n_tokens=2),
        _failed(make_rollout(2, group="g", n_tokens=2)),
    ]
    values = [torch.zeros(2), torch.zeros(2), torch.tensor([0.3, 0.7])]
    adv, ret = gae_targets(batch, AlgoConfig(advantage="gae", gamma=1.0, lam=1.0), 8, values)
    assert torch.allclose(torch.cat(adv[:2]), torch.tensor([1.0, 1.0, -1.0, -1.0]), atol=1e-6)  # as without it
    assert torch.equal(adv[2], torch.zeros(2)) and torch.equal(ret[2], values[2])  # no value error either


def test_explained_variance_leaves_rollouts_whose_reward_failed_out():
    from learners.step import explained_variance

    # A failed reward's targets are its own values, which would read as a perfect critic: left out, so a step
    # whose rewards all failed has nothing to explain, and a failed one does not improve a step's score.
    failed = _failed(make_rollout(0, group="g", n_tokens=2))
    values = [torch.tensor([0.2, 0.4])]
    assert explained_variance([failed], values, values) == {"value_mean": 0.0, "value_explained_var": 0.0}
    scored = make_rollout(1, group="g", reward=1.0, n_tokens=2)
    alone = explained_variance([scored], [torch.tensor([0.5, 0.5])], [torch.tensor([0.0, 1.0])])
    assert alone == {"value_mean": 0.5, "value_explained_var": 0.0}
    assert (
        explained_variance([scored, failed], [torch.tensor([0.5, 0.5]), *values], [torch.tensor([0.0, 1.0]), *values])
        == alone
    )


def test_stale_peers_count_in_their_groups_statistics_and_get_no_advantage_of_their_own():
    # Group g scored 1, 1 (fresh) and 0, 0 (long answers, dropped as stale). Alone the fresh pair is all
    # equal and teaches nothing; with its whole group: mean 0.5, std sqrt(1/3), advantage 0.5 / 0.57735.
    fresh = [make_rollout(0, group="g", reward=1.0, n_tokens=2), make_rollout(1, group="g", reward=1.0, n_tokens=2)]
    stale = [make_rollout(2, group="g", reward=0.0, n_tokens=6), make_rollout(3, group="g", reward=0.0, n_tokens=6)]
    alone = step_advantages(fresh, AlgoConfig(), max_new_tokens=8)
    assert all(float(a.abs().max()) == 0.0 for a in alone)
    whole = step_advantages(fresh, AlgoConfig(), max_new_tokens=8, stale_peers=stale)
    assert len(whole) == 2 and [a.shape[0] for a in whole] == [2, 2]
    assert torch.allclose(torch.cat(whole), torch.full((4,), 0.5 / (1 / 3) ** 0.5 + 0.0), atol=1e-3)
    rloo = step_advantages(fresh, AlgoConfig(advantage="rloo"), max_new_tokens=8, stale_peers=stale)
    assert torch.allclose(torch.cat(rloo), torch.full((4,), 1 - 1 / 3))  # its reward minus the mean of the others
    # Estimators that whiten over the batch's tokens take no peers (they have no tokens in the step).
    pp = step_advantages(fresh, AlgoConfig(advantage="reinforce_pp"), max_new_tokens=8, stale_peers=stale)
    assert [a.shape[0] for a in pp] == [2, 2]


def test_stale_peers_pay_their_groups_kl_penalty_so_an_all_right_group_has_nothing_to_learn():
    # Every answer right; each trained member's response is 5 nats of KL from the reference (kl_coef 0.1).
    # A peer without the penalty would stand 0.5 above the trained members and push both down.
    fresh = [make_rollout(i, group="g", reward=1.0, n_tokens=5) for i in range(2)]
    stale = [make_rollout(i, group="g", reward=1.0, n_tokens=5) for i in range(2, 4)]
    algo = AlgoConfig(advantage="grpo", kl_coef=0.1, kl_in="reward")
    kl = [torch.ones(5), torch.ones(5)]
    assert all(float(a.abs().max()) == 0.0 for a in step_advantages(fresh, algo, 8, kl, stale_peers=stale))
    # Members that paid more KL than their group's mean still lose advantage to the others, peers included.
    uneven = step_advantages(fresh, algo, 8, [torch.ones(5), torch.zeros(5)], stale_peers=stale)
    assert float(uneven[0][0]) < 0 < float(uneven[1][0])


def test_an_all_equal_group_gets_exactly_zero_whatever_its_reward():
    for reward in (0.7, 10.3, 999.9):
        batch = [make_rollout(i, group="g", reward=reward, n_tokens=1) for i in range(31)]
        assert all(float(a.abs().max()) == 0.0 for a in step_advantages(batch, AlgoConfig(), max_new_tokens=8))


@pytest.mark.parametrize("packed", [False, True])
def test_with_the_kl_in_the_reward_a_step_runs_the_reference_once_and_reports_that_kl(packed):
    """kl_in: reward measures each token's KL before the step (PolicyStep.reward_kl); the step reports it as
    kl_ref instead of running the reference again for a number the loss does not use."""
    from learners.ranks import Ranks
    from learners.step import PolicyStep

    class Engine(torch.nn.Module):  # what the step asks of DeepSpeed's engine, with a log-prob of -0.5 a token
        device = torch.device("cpu")

        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(()))

        def zero_optimization(self):  # DeepSpeed measures the gradient norm
            return True

        def forward(self, ids, attention, targets, temperature, positions, entropy_grad=False, predicting=None):
            return torch.full(targets.shape, -0.5) + self.bias, None

        def set_gradient_accumulation_boundary(self, boundary):
            pass

        def backward(self, loss, scale_wrt_gas):
            loss.backward()

        def step(self):
            pass

        def get_global_grad_norm(self):
            return 0.0

    config = load_config(
        None,
        [
            "--algo.advantage=reinforce_pp",
            "--algo.kl_coef=0.1",
            "--algo.kl_in=reward",
            f"--learner.pack_sequences={str(packed).lower()}",
        ],
    )
    reference_passes = []

    def reference(*inputs, predicting=None):
        reference_passes.append(1)
        return torch.full(inputs[2].shape, -0.7), None

    step = PolicyStep(config, Engine(), Ranks(0, 1, None), reference=reference)
    shard = [make_rollout(0, n_tokens=2), make_rollout(1, n_tokens=3)]
    token_kl = step.reward_kl(shard)
    k3 = math.exp(-0.2) + 0.2 - 1  # log-probs -0.5 (policy) and -0.7 (reference)
    assert len(reference_passes) == 1 and torch.allclose(torch.cat(token_kl), torch.full((5,), k3))
    advantages = [torch.zeros(2), torch.zeros(3)]
    stats = step.train(shard, 5, 2, advantages, token_kl=token_kl)
    assert len(reference_passes) == 1, "the step ran the reference again"
    assert stats["kl_ref"] == pytest.approx(float(torch.cat(token_kl).mean()))
