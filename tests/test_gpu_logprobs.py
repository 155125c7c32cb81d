"""The compiled log-prob tail on a GPU equals a float64 reference, for chunks of two lengths."""

import pytest

pytestmark = pytest.mark.gpu


def test_compiled_log_prob_tail_matches_float64_on_the_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from learners.loss import _LogprobsFromLogits

    torch.manual_seed(0)
    for rows in (1024, 333):  # a full chunk and a micro-batch's shorter last one
        logits = (4 * torch.randn(rows, 151936, device="cuda")).bfloat16().requires_grad_()
        targets = torch.randint(0, 151936, (rows,), device="cuda")
        weights = torch.randn(rows, device="cuda", dtype=torch.float64)
        picked, entropy = _LogprobsFromLogits.apply(logits, targets, 0.9, True)
        (grad,) = torch.autograd.grad((picked * weights + entropy * weights.flip(0)).sum(), logits)

        leaf = logits.detach().double().requires_grad_()
        log_p = torch.log_softmax(leaf / 0.9, -1)
        want_picked = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        want_entropy = -(log_p.exp() * log_p).sum(-1)
        (want,) = torch.autograd.grad((want_picked * weights + want_entropy * weights.flip(0)).sum(), leaf)
        assert torch.allclose(picked.double(), want_picked, atol=1e-4)
        assert torch.allclose(entropy.double(), want_entropy, atol=1e-4)
        assert grad.dtype == torch.bfloat16
        assert torch.allclose(grad.double(), want, atol=1e-3, rtol=2e-2)
