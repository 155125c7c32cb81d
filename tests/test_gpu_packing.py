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


def random_qwen2(torch):
    """A random 2-layer Qwen2 (grouped-query attention) in bf16 on the GPU, and the learner's log-prob forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learners.engine import PolicyLogprobs

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
    return model, PolicyLogprobs(model, chunk_tokens=256)


@pytest.mark.parametrize("packed_rows, implementation", [(True, "flex_attention"), (True, "varlen"), (False, "varlen")])
def test_packed_rows_match_padded_rows_under_sdpa(cuda, packed_rows, implementation):
    """Padded rows under varlen too: the reference's and critic's passes, and a rank's empty micro-batch."""
    torch = cuda
    from learners.packing import pack

    model, policy = random_qwen2(torch)
    rollouts = rollouts_of_lengths([(37, 90), (120, 3), (64, 400), (5, 61), (250, 128)])
    results = {}
    for name, packed, attention in (("reference", False, "sdpa"), ("tested", packed_rows, implementation)):
        model.set_attn_implementation(attention)
        model.zero_grad()
        ids, mask_in, positions, targets, _, mask, _, _ = pack(rollouts, packed).to("cuda")[:8]
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
        ids, mask_in, positions, targets, _, mask, adv, _ = pack(rollouts, packed, advantages).to("cuda")[:8]
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


def test_rows_holding_each_prompt_once_match_padded_rows_under_sdpa(cuda):
    """learner.share_prompts on torch's flash varlen kernel: a rollout's tokens see its prompt's shared tokens
    and their own causally, aligned to the last key (the kernel's alignment where queries are fewer than keys)."""
    torch = cuda
    from learners.packing import pack, response_values

    model, policy = random_qwen2(torch)
    base = rollouts_of_lengths([(100, 84), (100, 20), (100, 96), (37, 5), (37, 61), (1, 7)])
    # three groups: the first three rollouts, the next two, and the last, each sharing its first's prompt
    import msgspec

    rollouts = [
        msgspec.structs.replace(r, prompt_ids=base[{0: 0, 1: 0, 2: 0, 3: 3, 4: 3, 5: 5}[i]].prompt_ids)
        for i, r in enumerate(base)
    ]
    results = {}
    for name, packed, shared, attention in (("reference", False, False, "sdpa"), ("shared", True, True, "varlen")):
        model.set_attn_implementation(attention)
        model.zero_grad()
        batch = pack(rollouts, packed, shared=shared).to("cuda")
        logprobs, _ = policy(
            batch.ids, batch.attention_mask, batch.targets, 0.9, batch.position_ids, **batch.logprob_options()
        )
        logprobs[batch.mask.bool()].sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        values = response_values(logprobs.detach().float().cpu(), rollouts, packed, shared=shared)
        results[name] = torch.cat(values), grads, batch.ids.numel()
    (padded, padded_grads, _), (shared, shared_grads, tokens) = results["reference"], results["shared"]
    assert tokens == 99 + 36 + 0 + sum(1 + len(r.response_ids) for r in rollouts)
    assert (padded - shared).abs().max() < 0.05, (padded - shared).abs().max()
    cosine = torch.nn.functional.cosine_similarity(padded_grads, shared_grads, dim=0)
    assert cosine > 0.999, cosine


def test_the_kernel_aligns_a_span_of_fewer_queries_than_keys_to_its_last_key(cuda):
    """What learner.share_prompts auto checks once per process before it shares prompts."""
    from learners.attention import shared_spans_unavailable

    assert shared_spans_unavailable() is None
