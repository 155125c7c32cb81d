"""Packed rows on a GPU (learner.pack_sequences with attn_implementation flex_attention or varlen): the same
log-probs and gradients as padded rows under sdpa, so no rollout attends to another."""

import pytest
from conftest import rollouts_of_lengths

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("packed_rows, implementation", [(True, "flex_attention"), (True, "varlen"), (False, "varlen")])
def test_packed_rows_match_padded_rows_under_sdpa(packed_rows, implementation):
    """Padded rows under varlen too: the reference's and critic's passes, and a rank's empty micro-batch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import learners.attention  # noqa: F401  (registers varlen)
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
        ids, mask_in, positions, targets, _, mask, _ = (
            t.cuda() if t is not None else None for t in pack(rollouts, packed)
        )
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
