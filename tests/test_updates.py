"""Several optimizer updates a step: ``learner.mini_batches`` of whole groups, ``learner.epochs`` passes."""

import msgspec
import pytest
import torch
from conftest import make_rollout

import learners.step
from asyncrl.config import load_config
from learners.ranks import Ranks
from learners.step import PolicyStep, merged, mini_batches


def groups(*sizes: int) -> list:
    return [make_rollout(i, group=f"g{g}") for g, size in enumerate(sizes) for i in range(size)]


def test_mini_batches_hold_whole_groups_in_batch_order_as_even_as_can_be():
    batch = groups(2, 2, 2, 2, 2)
    assert mini_batches(batch, 1) == [list(range(10))]
    assert mini_batches(batch, 2) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert mini_batches(batch, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # fewer groups than mini-batches (a step whose groups were dropped): a group each
    assert mini_batches(groups(3, 1), 4) == [[0, 1, 2], [3]]
    # a group's members need not stand together in the batch
    mixed = [make_rollout(0, group="a"), make_rollout(0, group="b"), make_rollout(1, group="a")]
    assert mini_batches(mixed, 2) == [[0, 2], [1]]


def test_a_steps_figures_are_the_means_of_its_updates_and_count_them():
    one = {"loss": 0.5, "clip_fraction": 0.0, "microbatches": 2}
    assert merged([one]) == {**one, "updates": 1}
    two = merged([one, {"loss": 0.25, "clip_fraction": 0.2, "microbatches": 3}])
    assert two == {"loss": 0.375, "clip_fraction": 0.1, "microbatches": 5, "updates": 2}
    # the largest importance ratio of the step is its updates' largest, not their mean
    ratios = merged([{"is_ratio_max": 1.5, "microbatches": 1}, {"is_ratio_max": 3.0, "microbatches": 1}])
    assert ratios["is_ratio_max"] == 3.0


class Engine(torch.nn.Module):
    """What the step asks of DeepSpeed's engine: every token's log-prob is -0.5 plus one trained bias, and an
    optimizer step (plain SGD) at each gradient-accumulation boundary."""

    device = torch.device("cpu")

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.boundary, self.rows, self.updates = False, 0, []  # rows seen by each optimizer update

    def zero_optimization(self):
        return True

    def forward(self, ids, attention, targets, temperature, positions, entropy_grad=False, predicting=None):
        self.rows += ids.shape[0]
        return torch.full(targets.shape, -0.5) + self.bias, None

    def set_gradient_accumulation_boundary(self, boundary):
        self.boundary = boundary

    def backward(self, loss, scale_wrt_gas):
        loss.backward()

    def step(self):
        if self.boundary:
            with torch.no_grad():
                self.bias -= 0.5 * self.bias.grad
            self.bias.grad = None
            self.updates.append(self.rows)
            self.rows = 0

    def get_global_grad_norm(self):
        return 0.0


def config(*overrides: str):
    return load_config(None, ["--learner.pack_sequences=false", *overrides])


def batch_of_four_groups() -> list:
    # right answers are short, wrong ones long: under the token mean their pulls on the bias do not cancel
    return [
        make_rollout(i, group=f"g{g}", group_size=2, reward=float(i == 0), n_tokens=2 if i == 0 else 4)
        for g in range(4)
        for i in range(2)
    ]


def test_one_update_a_step_unless_told_and_its_figures_are_the_steps():
    engine = Engine()
    stats = PolicyStep(config(), engine, Ranks(0, 1, None)).run(batch_of_four_groups(), [])
    assert engine.updates == [8] and stats["updates"] == 1
    assert stats["approx_kl"] == 0.0  # the one update's ratio is taken before it moves anything


def test_mini_batches_and_epochs_each_step_the_optimizer_and_later_updates_see_the_policy_move():
    engine = Engine()
    step = PolicyStep(
        config("--learner.mini_batches=2", "--learner.epochs=2", "--learner.groups_per_step=4"),
        engine,
        Ranks(0, 1, None),
    )
    stats = step.train(batch_of_four_groups(), 24, 8, [torch.zeros(n) for n in [2, 4] * 4])  # nothing to learn
    assert engine.updates == [8] and float(engine.bias.detach()) == 0.0
    engine.updates.clear()
    stats = step.run(batch_of_four_groups(), [])
    # two mini-batches of two groups (4 rollouts), twice
    assert engine.updates == [4, 4, 4, 4] and stats["updates"] == 4 and stats["microbatches"] == 4
    # a bias shared by every token: the wrong answers hold more of the token mean, so it falls
    assert float(engine.bias.detach()) < 0
    # each update's ratio is against the behaviour log-probs: the first saw none of the step's movement, the
    # later ones did, and the step reports their mean
    assert stats["approx_kl"] > 0


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_learner_logprobs_kept_of_a_rollout_are_from_before_the_step_moved_the_weights(epochs):
    step = PolicyStep(config(f"--learner.epochs={epochs}"), Engine(), Ranks(0, 1, None))
    batch = batch_of_four_groups()
    step.keep = {batch[0].rollout_id}
    step.run(batch, [])
    assert step.learner_logprobs == {batch[0].rollout_id: [-0.5, -0.5]}


class TokenEngine(Engine):
    """The log-prob of a token depends on its id, so a value placed at the wrong token or rollout shows."""

    def forward(self, ids, attention, targets, temperature, positions, entropy_grad=False, predicting=None):
        self.rows += ids.shape[0]
        return -0.5 - 0.001 * targets.float() + self.bias, None


@pytest.mark.parametrize("off_policy", ["none", "decoupled"])
def test_with_a_correction_every_update_takes_its_ratio_against_the_log_probs_from_before_the_step(
    monkeypatch, off_policy
):
    seen = []  # (anchor, policy, mask) of each update's one micro-batch

    def recording(logprobs, behaviour, advantages, mask, *args, proximal_logprobs=None, **kwargs):
        seen.append((proximal_logprobs, logprobs.detach().clone(), mask.bool()))
        return policy_loss(logprobs, behaviour, advantages, mask, *args, proximal_logprobs=proximal_logprobs, **kwargs)

    policy_loss = learners.step.policy_loss
    monkeypatch.setattr(learners.step, "policy_loss", recording)
    engine = TokenEngine()
    cfg = config("--learner.mini_batches=2", "--learner.epochs=2", f"--algo.off_policy={off_policy}")
    # every rollout its own token ids; the generator sampled with other weights: 0.2 below the learner's
    batch = []
    for k, rollout in enumerate(batch_of_four_groups()):
        ids = [100 + 10 * k + j for j in range(len(rollout.response_ids))]
        behaviour = [-0.5 - 0.001 * i - 0.2 for i in ids]
        batch.append(msgspec.structs.replace(rollout, response_ids=ids, logprobs=behaviour))
    step = PolicyStep(cfg, engine, Ranks(0, 1, None))
    step.keep = {batch[-1].rollout_id}  # in the second mini-batch
    stats = step.run(batch, [])
    assert stats["updates"] == 4 and len(seen) == 4
    if off_policy == "none":  # PPO on the generator's numbers: no learner pass before the step
        assert [anchor for anchor, _, _ in seen] == [None] * 4 and engine.updates == [4, 4, 4, 4]
        # the kept log-probs are the first to train the rollout: after the first mini-batch's update
        assert step.learner_logprobs[batch[-1].rollout_id] != [-0.5 - 0.001 * i for i in batch[-1].response_ids]
        return
    # one pass over the batch (8 rows) before the first update, its log-probs the anchor of all four
    assert engine.updates == [8 + 4, 4, 4, 4]
    for u, (anchor, policy, mask) in enumerate(seen):
        # token for token, the policy less the weights' movement so far: nothing misplaced, nothing recomputed
        gap = (policy - anchor)[mask]
        assert torch.allclose(gap, gap[0].expand_as(gap), atol=1e-6), u
        assert (u == 0) == (abs(float(gap[0])) < 1e-9)
    # the mismatch is proximal against behaviour in every update: exp(0.2) - 1 - 0.2
    assert stats["mismatch_kl"] == pytest.approx(0.0214, abs=1e-4)
    # the kept log-probs are from before the step, though the rollout trains after the first update
    assert step.learner_logprobs[batch[-1].rollout_id] == pytest.approx(
        [-0.5 - 0.001 * i for i in batch[-1].response_ids]
    )
