"""Packed rows on a GPU (learner.pack_sequences with attn_implementation flex_attention or varlen): the same
log-probs and gradients as padded rows under sdpa, so no rollout attends to another."""

import pytest
from conftest import rollouts_of_lengths

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    """torch, on a machine with a GPU; ``varlen`` registered with transformers."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import learners.attention  # noqa: F401  (registers varlen)

    return torch


@pytest.mark.parametrize("packed_rows, implementation", [(True, "flex_attention"), (True, "varlen"), (False, "varlen")])
def test_packed_rows_match_padded_rows_under_sdpa(cuda, packed_rows, implementation):
    """Padded rows under varlen too: the reference's and critic's passes, and a rank's empty micro-batch."""
    torch = cuda
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learners.engine import PolicyLogprobs
    from learners.packing import pack

    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).cuda().to(torch.bfloat16)
    policy = PolicyLogprobs(model, chunk_tokens=256)
    rollouts = rollouts_of_lengths([(37, 90), (120, 3), (64, 400), (5, 61), (250, 128)])
    results = {}
    for name, packed, attention in (("reference", False, "sdpa"), ("tested", packed_rows, implementation)):
        model.set_attn_implementation(attention)
        model.zero_grad()
        ids, mask_in, positions, targets, _, mask, _, _ = pack(rollouts, packed).to("cuda")
        assert ids.shape[0] == (1 if packed else len(rollouts))
        logprobs, entropy = policy(ids, mask_in, targets, 0.9, positions)
        logprobs[mask.bool()].sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        results[name] = logprobs[mask.bool()].float(), entropy[mask.bool()].float(), grads
    (padded, padded_entropy, padded_grads), (tested, tested_entropy, tested_grads) = (
        results["reference"],
        results["tested"],
    )
    assert padded.numel() == tested.numel() == 90 + 3 + 400 + 61 + 128
    # bf16 activations: attention across rollouts would move these by far more (the model is random).
    assert (padded - tested).abs().max() < 0.05, (padded - tested).abs().max()
    assert (padded_entropy - tested_entropy).abs().max() < 0.05  # shape and scale: a random model's is near uniform
    cosine = torch.nn.functional.cosine_similarity(padded_grads, tested_grads, dim=0)
    assert cosine > 0.999, cosine


def test_a_policy_gradient_over_a_step_of_packed_rollouts_matches_padded_rows_parameter_by_parameter(cuda):
    """A step's worth of rollouts (128, one packed row) under varlen with signed advantages, on a SmolLM2-shaped
    model (9 query heads sharing 3 key/value heads): every parameter's gradient is as close to the fp32 padded
    one as bf16 padded rows are. A whole-model cosine can hide a wrong key/value gradient (a small share of the
    norm); this compares each parameter, the attention projections included."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from learners.engine import PolicyLogprobs
    from learners.packing import pack

    torch = cuda
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    rollouts = rollouts_of_lengths([(40 + i % 30, 10 + (i * 37) % 87) for i in range(128)])
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(1)).tolist()

    def gradients(dtype, packed, attention):
        model = copy.deepcopy(base).to("cuda", dtype)
        model.set_attn_implementation(attention)
        policy = PolicyLogprobs(model, chunk_tokens=4096)
        ids, mask_in, positions, targets, _, mask, adv, _ = pack(rollouts, packed, advantages).to("cuda")
        logprobs, _ = policy(ids, mask_in, targets, 1.0, positions)
        (-(adv * logprobs.float() * mask).sum() / mask.sum()).backward()
        return {name: p.grad.float().flatten() for name, p in model.named_parameters()}

    reference = gradients(torch.float32, False, "sdpa")
    errors = {}
    for case, packed, attention in (("padded", False, "sdpa"), ("packed", True, "varlen")):
        grads = gradients(torch.bfloat16, packed, attention)
        errors[case] = {name: ((grads[name] - g).norm() / g.norm()).item() for name, g in reference.items()}
    assert any("k_proj" in name for name in errors["packed"])
    worse = {
        name: (error, errors["padded"][name])
        for name, error in errors["packed"].items()
        if error > 1.5 * errors["padded"][name] + 1e-3
    }
    assert not worse, worse
