import torch

from learners.loss import token_logprobs


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


def test_entropy_carries_gradients_only_when_asked():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 20, (2, 5))
    _, plain = token_logprobs(head, hidden, targets, chunk_tokens=3)
    assert not plain.requires_grad
    _, entropy = token_logprobs(head, hidden, targets, chunk_tokens=3, entropy_grad=True)
    probs = torch.softmax(head(hidden), -1)
    expected = -(probs * probs.log()).sum(-1)
    assert torch.allclose(entropy, expected, atol=1e-6)
    (got,) = torch.autograd.grad(entropy.sum(), hidden)
    (want,) = torch.autograd.grad(expected.sum(), hidden)
    assert torch.allclose(got, want, atol=1e-5)
