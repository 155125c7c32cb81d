import torch

from learners.loss import group_advantages, ppo_clip_loss, token_logprobs


def test_group_advantages_normalise_within_groups():
    adv = group_advantages([1.0, 0.0, 5.0, 5.0, 2.0], ["a", "a", "b", "b", "c"])
    assert adv[0] > 0 > adv[1]
    assert torch.allclose(adv[:2].sum(), torch.tensor(0.0), atol=1e-6)
    assert torch.equal(adv[2:], torch.zeros(3))  # equal rewards and singletons carry no signal


def test_chunked_logprobs_equal_plain_ones_with_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    plain = torch.log_softmax(head(hidden).float() / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    chunked, entropy = token_logprobs(head, hidden, targets, temperature=0.7, chunk_tokens=4)
    assert torch.allclose(chunked, plain, atol=1e-6)
    (g_plain,) = torch.autograd.grad(plain.sum(), hidden)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    assert torch.allclose(g_chunked, g_plain, atol=1e-6)
    assert entropy.shape == targets.shape and (entropy > 0).all()


def test_ppo_clip_loss_clips_and_is_a_token_mean():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -1.0]])  # second token: ratio e > 1 + eps
    mask = torch.tensor([[1.0, 1.0]])
    stats = ppo_clip_loss(lp, behaviour, torch.tensor([1.0]), mask, torch.zeros(1, 2), clip_eps=0.2, num_tokens=2)
    assert abs(stats.loss.item() - (-(1.0 + 1.2) / 2)) < 1e-6
    assert stats.clip_fraction == 0.5
    stats.loss.backward()
    assert lp.grad[0, 1] == 0  # the clipped token gets no gradient


def test_kl_penalty_is_zero_at_the_reference_and_pulls_towards_it():
    behaviour = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    reference = torch.tensor([[-1.0, -1.0, -1.0]])
    at_ref = ppo_clip_loss(reference.clone().requires_grad_(), behaviour, torch.zeros(1), mask, torch.zeros(1, 3),
                           0.2, 3, reference, kl_coef=0.5)
    assert at_ref.kl_ref == 0.0 and at_ref.loss.item() == 0.0
    lp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    stats = ppo_clip_loss(lp, behaviour, torch.zeros(1), mask, torch.zeros(1, 3), 0.2, 3, reference, kl_coef=0.5)
    assert stats.kl_ref > 0
    stats.loss.backward()
    # With no advantage, only the penalty acts: it moves each log-prob towards the reference's.
    assert lp.grad[0, 0] > 0 and lp.grad[0, 1] == 0 and lp.grad[0, 2] < 0
