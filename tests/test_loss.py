import pytest
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


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logprobs = torch.log_softmax(logits.double() / temperature, -1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked, -(logprobs.exp() * logprobs).sum(-1)


def test_hand_written_backward_matches_autograd_for_log_prob_and_entropy():
    from learners.loss import _LogprobsFromLogits

    torch.manual_seed(1)
    logits = (3 * torch.randn(6, 40, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 40, (6,))
    weights = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    picked, entropy = _LogprobsFromLogits.apply(logits, targets, 0.7, True)
    want_picked, want_entropy = _reference(logits, targets, 0.7)
    assert torch.allclose(picked, want_picked) and torch.allclose(entropy, want_entropy)
    got = torch.autograd.grad((picked * weights[0] + entropy * weights[1]).sum(), logits)[0]
    want = torch.autograd.grad((want_picked * weights[0] + want_entropy * weights[1]).sum(), logits)[0]
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: _LogprobsFromLogits.apply(x, targets, 1.3, True), (logits,))


def test_bfloat16_logits_get_bfloat16_gradients_close_to_a_float64_reference():
    from learners.loss import _LogprobsFromLogits

    torch.manual_seed(2)
    logits = (4 * torch.randn(5, 300)).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (5,))
    picked, entropy = _LogprobsFromLogits.apply(logits, targets, 0.8, False)
    assert picked.dtype == torch.float32 and not entropy.requires_grad
    want_picked, want_entropy = _reference(logits.detach(), targets, 0.8)
    assert torch.allclose(picked.double(), want_picked, atol=1e-5)
    assert torch.allclose(entropy.double(), want_entropy, atol=1e-5)
    (got,) = torch.autograd.grad(picked.sum(), logits)
    leaf = logits.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(_reference(leaf, targets, 0.8)[0].sum(), leaf)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "cohere"])
def test_the_learners_log_probs_are_those_of_the_models_own_logits(family):
    """Gemma 2 caps its logits, Granite divides and Cohere multiplies them after ``lm_head``, as vLLM does when
    it samples: the learner's forward, which calls ``lm_head`` itself, must do the same or every ratio is off."""
    import transformers

    from learners.engine import PolicyLogprobs

    shape = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    config, cls = {
        "llama": (transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM),
        "gemma2": (transformers.Gemma2Config(**shape, final_logit_softcapping=3.0), transformers.Gemma2ForCausalLM),
        "granite": (transformers.GraniteConfig(**shape, logits_scaling=4.0), transformers.GraniteForCausalLM),
        "cohere": (transformers.CohereConfig(**shape, logit_scale=0.25), transformers.CohereForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)  # logits large enough for a cap or a scale to matter
    ids = torch.randint(0, 256, (2, 9))
    targets = ids[:, 1:]
    with torch.no_grad():
        expected, _ = _reference(model(ids).logits[:, :-1], targets, 0.8)
        got, _ = PolicyLogprobs(model, chunk_tokens=5)(ids[:, :-1], torch.ones_like(targets), targets, 0.8)
        plain, _ = token_logprobs(
            model.get_output_embeddings(), model.get_decoder()(ids[:, :-1]).last_hidden_state, targets, 0.8
        )
    assert (got.double() - expected).abs().max() < 1e-4
    if family != "llama":
        assert (plain.double() - expected).abs().max() > 0.1, "the bare lm_head would have differed"
