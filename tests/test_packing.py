"""Micro-batch inputs (learners.packing) against a plain per-rollout construction."""

import random

import msgspec
import pytest
import torch
from conftest import rollouts_of_lengths

from asyncrl.wire.protocol import Rollout
from learners.attention import segments  # importing it registers varlen with transformers
from learners.packing import document_block_mask, pack, packed_attention_inputs, place, response_values


def rollout(rng: random.Random, i: int) -> Rollout:
    p, n = rng.randint(1, 6), rng.randint(1, 5)
    return Rollout(
        rollout_id=f"r{i}",
        group_id="g",
        group_size=1,
        prompt_index=0,
        prompt_ids=[rng.randint(1, 50) for _ in range(p)],
        response_ids=[rng.randint(1, 50) for _ in range(n)],
        logprobs=[-rng.random() for _ in range(n)],
        versions=[0] * n,
        reward=0.0,
        finish_reason="length",
        generator_id="x",
        created_s=0.0,
        generate_s=0.0,
    )


def reference(rollouts, packed, advantages):
    """One rollout at a time, the obvious way."""
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    rows, width = (1, sum(lengths)) if packed else (len(rollouts), max(lengths))
    ids, attention, positions, targets = (torch.zeros(rows, width, dtype=torch.long) for _ in range(4))
    behaviour, mask, adv = (torch.zeros(rows, width) for _ in range(3))
    at = 0
    for k, (r, a) in enumerate(zip(rollouts, advantages)):
        row, off = (0, at) if packed else (k, 0)
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[row, off : off + p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        attention[row, off : off + p + n] = 1
        positions[row, off : off + p + n] = torch.arange(p + n)
        span = slice(off + p - 1, off + p + n - 1)
        targets[row, span] = torch.tensor(r.response_ids)
        behaviour[row, span] = torch.tensor(r.logprobs)
        mask[row, span] = 1
        adv[row, span] = torch.as_tensor(a, dtype=torch.float32)
        at += p + n
    return ids, attention, positions, targets, behaviour, mask, adv


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_pack_matches_the_per_rollout_construction(packed, per_token):
    rng = random.Random(packed * 2 + per_token)
    rollouts = [rollout(rng, i) for i in range(9)]
    advantages = (
        [torch.randn(len(r.response_ids)) for r in rollouts]
        if per_token
        else [float(rng.gauss(0, 1)) for _ in rollouts]
    )
    got = pack(rollouts, packed, advantages)
    ids, attention, positions, targets, behaviour, mask, adv = reference(rollouts, packed, advantages)
    assert torch.equal(got[0], ids) and torch.equal(got[3], targets)
    assert torch.equal(got[5], mask) and torch.allclose(got[4], behaviour) and torch.allclose(got[6], adv)
    if packed:
        assert got[1] is None and torch.equal(got[2], positions)
    else:
        assert got[2] is None and torch.equal(got[1], attention)
    assert torch.allclose(place(rollouts, packed, advantages), adv)


@pytest.mark.parametrize("packed", [False, True])
def test_response_values_give_each_rollout_its_own_response_tokens_back(packed):
    rng = random.Random(7)
    rollouts = [rollout(rng, i) for i in range(6)]
    rollouts[2] = Rollout(
        **{
            **{f: getattr(rollouts[2], f) for f in rollouts[2].__struct_fields__},
            "response_ids": [],
            "logprobs": [],
            "versions": [],
        }
    )  # an empty response
    ids, attention, positions, targets, behaviour, mask, _, _ = pack(rollouts, packed)[:8]
    by_target = response_values(targets.float(), rollouts, packed)
    by_behaviour = response_values(behaviour, rollouts, packed)
    assert [v.long().tolist() for v in by_target] == [r.response_ids for r in rollouts]
    assert all(torch.allclose(v, torch.tensor(r.logprobs)) for v, r in zip(by_behaviour, rollouts))


@pytest.mark.parametrize("packed", [False, True])
def test_an_episodes_loss_mask_leaves_the_environments_tokens_out_of_the_loss(packed):
    """A multi-turn episode's tool results are context: the mask is 0 on them, and 1 on the model's turns."""
    rng = random.Random(3)
    plain = rollout(rng, 0)
    loss_mask = [1, 1, 0, 0, 0, 1]  # a turn, the environment's reply, the last turn
    episode = msgspec.structs.replace(
        rollout(rng, 1), response_ids=[5, 6, 7, 8, 9, 10], logprobs=[-0.5] * 6, versions=[0] * 6, loss_mask=loss_mask
    )
    ids, attention, positions, targets, behaviour, mask, _, _ = pack([plain, episode], packed)[:8]
    masks = response_values(mask, [plain, episode], packed)
    assert masks[0].tolist() == [1.0] * len(plain.response_ids)
    assert masks[1].tolist() == [float(m) for m in loss_mask]
    assert int(mask.sum()) == len(plain.response_ids) + sum(loss_mask)
    # every response position is still a target: the environment's tokens are read, only not trained on
    assert response_values(targets.float(), [plain, episode], packed)[1].long().tolist() == episode.response_ids


def test_an_empty_micro_batch_is_one_masked_row():
    ids, attention, positions, targets, behaviour, mask, adv, _ = pack([], False, [])[:8]
    assert ids.shape == (1, 2) and attention.sum() == 2 and mask.sum() == 0 and adv.sum() == 0


def _blocks_listed(count: torch.Tensor, indices: torch.Tensor, row: int, blocks: int) -> torch.Tensor:
    listed = torch.zeros(blocks, blocks, dtype=torch.bool)
    for i in range(blocks):
        listed[i, indices[row, 0, i, : count[row, 0, i]].long()] = True
    return listed


@pytest.mark.parametrize(
    "rows",
    [
        [[37, 90, 120, 3, 64, 400, 5, 61, 250, 128]],
        [[128, 128, 256]],
        [[1000]],
        [[1, 1, 1, 1, 1, 700]],
        [[129, 1]],
        [[300, 212], [12, 500]],
    ],
)
def test_the_packed_block_mask_is_causal_within_each_rollout_and_lists_exactly_the_blocks_that_need_computing(rows):
    """Flex attention computes only the listed blocks and applies the mask only to the partial ones: a block
    left out would drop attention, a block wrongly marked full would let tokens see other rollouts or later
    tokens of their own."""
    block = 128
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    length = positions.shape[1]
    mask = document_block_mask(positions, block)
    assert mask.shape == (len(rows), 1, length, length)
    blocks = -(-length // block)
    token = torch.arange(length)
    for row in range(len(rows)):
        rollout = (positions[row] == 0).long().cumsum(0)
        allowed = (rollout[:, None] == rollout[None, :]) & (token[None, :] <= token[:, None])
        tiles = [
            [allowed[i * block : (i + 1) * block, j * block : (j + 1) * block] for j in range(blocks)]
            for i in range(blocks)
        ]
        some = torch.tensor([[t.any() for t in tiles_i] for tiles_i in tiles])
        every = torch.tensor([[t.all() for t in tiles_i] for tiles_i in tiles])
        partial = _blocks_listed(mask.kv_num_blocks, mask.kv_indices, row, blocks)
        full = _blocks_listed(mask.full_kv_num_blocks, mask.full_kv_indices, row, blocks)
        assert not (partial & full).any()
        assert torch.equal(partial | full, some)
        assert not (full & ~every).any()  # the mask is skipped only where every pair may attend
        off_diagonal = ~torch.eye(blocks, dtype=torch.bool)  # a one-token tail block is listed partial, not full
        assert torch.equal(full & off_diagonal, every & off_diagonal)
        b = torch.tensor(row)
        per_pair = torch.vmap(
            torch.vmap(lambda q, kv, b=b: mask.mask_mod(b, b * 0, q, kv), in_dims=(None, 0)), in_dims=(0, None)
        )(token, token)
        assert torch.equal(per_pair, allowed)


@pytest.mark.parametrize("implementation", ["flex_attention", "varlen"])
def test_packed_rows_refuse_a_model_with_sliding_window_layers(implementation):
    """Neither the block mask nor varlen has a window, and transformers would use them in the sliding layers."""
    from transformers import Qwen2Config

    config = Qwen2Config(use_sliding_window=True, sliding_window=16, num_hidden_layers=2, max_window_layers=1)
    config._attn_implementation = implementation
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    with pytest.raises(ValueError, match=f"{implementation}: qwen2 has sliding-window attention .sliding_window 16"):
        packed_attention_inputs(config, None, positions)
    config._attn_implementation = "sdpa"  # transformers builds the mask itself, window included
    assert packed_attention_inputs(config, None, positions) == {"attention_mask": None}
    plain = Qwen2Config(num_hidden_layers=2)
    plain._attn_implementation = implementation
    inputs = packed_attention_inputs(plain, None, positions)
    if implementation == "flex_attention":
        assert inputs["attention_mask"].shape == (1, 1, 6, 6)
    else:  # the rollouts' starts and the row's end, and the longest rollout
        assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6] and inputs["max_length_q"] == 3


def tiny_policy():
    """A random 2-layer Llama with grouped-query attention, and the learner's log-prob forward around it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from learners.engine import PolicyLogprobs

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return model, PolicyLogprobs(model, chunk_tokens=256)


@pytest.mark.slow
def test_packed_rows_under_flex_attention_give_the_log_probs_of_padded_rows_under_sdpa():
    """The learner's forward with that block mask, end to end on CPU (forward only: flex attention has no CPU
    backward; tests/test_gpu_packing.py checks gradients on a GPU). Rollouts attending to one another would move
    these log-probs far more than float32 rounding."""
    model, policy = tiny_policy()
    rollouts = rollouts_of_lengths([(37, 90), (120, 3), (64, 400), (5, 61), (250, 128)])
    logprobs = {}
    for packed, attention in ((False, "sdpa"), (True, "flex_attention")):
        model.set_attn_implementation(attention)
        ids, attention_mask, positions, targets, _, mask, _, _ = pack(rollouts, packed)[:8]
        with torch.no_grad():
            values, _ = policy(ids, attention_mask, targets, 0.9, positions)
        logprobs[packed] = values[mask.bool()]
    assert logprobs[True].numel() == 90 + 3 + 400 + 61 + 128
    assert (logprobs[False] - logprobs[True]).abs().max() < 1e-4


def test_packed_rows_under_varlen_give_the_log_probs_and_gradients_of_padded_rows_under_sdpa():
    """``attn_implementation: varlen`` end to end through the learner's forward and backward. On a CPU each rollout
    goes through sdpa alone (tests/test_gpu_packing.py runs torch's flash varlen kernel); what this checks is the
    plumbing: the boundaries found once per forward, passed down to every layer, heads and layout put back."""
    model, policy = tiny_policy()
    rollouts = rollouts_of_lengths([(37, 90), (120, 3), (64, 200), (5, 61), (1, 1)])
    logprobs, grads = {}, {}
    for packed, attention in ((False, "sdpa"), (True, "varlen")):
        model.set_attn_implementation(attention)
        model.zero_grad()
        ids, attention_mask, positions, targets, _, mask, _, _ = pack(rollouts, packed)[:8]
        values, _ = policy(ids, attention_mask, targets, 0.9, positions)
        values[mask.bool()].sum().backward()
        logprobs[packed] = values[mask.bool()].detach()
        grads[packed] = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    assert logprobs[True].numel() == 90 + 3 + 200 + 61 + 1
    assert (logprobs[False] - logprobs[True]).abs().max() < 1e-4
    assert torch.allclose(grads[False], grads[True], atol=1e-5, rtol=1e-4)


def test_padded_rows_and_an_empty_micro_batch_run_under_varlen():
    """The reference's and critic's per-token passes give varlen padded rows, and a rank with no micro-batch left
    gives it one fully masked row: each row is cut into its tokens and its padding."""
    model, policy = tiny_policy()
    rollouts = rollouts_of_lengths([(37, 90), (120, 3), (5, 61)])
    ids, attention_mask, positions, targets, _, mask, _, _ = pack(rollouts, False)[:8]
    # Rows of 127, 123 and 66 tokens, 127 wide: each row's tokens, then its padding (the longest row has none).
    assert segments(attention_mask, None)["cu_seq_lens_q"].tolist() == [0, 127, 250, 254, 320, 381]
    logprobs = {}
    for attention in ("sdpa", "varlen"):
        model.set_attn_implementation(attention)
        with torch.no_grad():
            values, _ = policy(ids, attention_mask, targets, 0.9, positions)
        logprobs[attention] = values[mask.bool()]
    assert (logprobs["sdpa"] - logprobs["varlen"]).abs().max() < 1e-4
    ids, attention_mask, positions, targets, _, mask, _, _ = pack([], True)[:8]
    values, _ = policy(ids, attention_mask, targets, 0.9, positions)
    values.sum().backward()  # the collectives' forward and backward run; nothing is counted
    assert mask.sum() == 0 and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with pytest.raises(ValueError, match="right-padded rows"):
        segments(torch.tensor([[0, 1, 1]]), None)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_log_probs_of_the_response_positions_alone_are_those_of_every_position(packed):
    """The step computes the output projection and the log-softmax only where a response token is predicted:
    those log-probs, entropies and the loss's gradient must be exactly what the whole row gives, and a prompt
    position must read 0 (nothing reads it, and nothing can be trained on it by mistake)."""
    model, policy = tiny_policy()
    rollouts = rollouts_of_lengths([(37, 9), (120, 3), (64, 20), (5, 61)])
    ids, attention_mask, positions, targets, _, mask, _, wanted = pack(rollouts, packed)[:8]
    assert wanted.numel() == 9 + 3 + 20 + 61 and bool(mask.reshape(-1)[wanted].all())
    results = {}
    for name, where in (("every", None), ("response", wanted)):
        model.zero_grad()
        logprobs, entropy = policy(ids, attention_mask, targets, 0.9, positions, predicting=where)
        (logprobs * mask).sum().backward()
        grads = (model.lm_head.weight.grad.clone(), model.model.layers[0].mlp.up_proj.weight.grad.clone())
        results[name] = logprobs.detach(), entropy.detach(), grads
    (every, every_entropy, every_grads), (response, response_entropy, response_grads) = results.values()
    on = mask.bool()
    assert torch.allclose(response[on], every[on], atol=1e-6) and torch.allclose(
        response_entropy[on], every_entropy[on], atol=1e-5
    )
    assert response[~on].abs().max() == 0 and response_entropy[~on].abs().max() == 0
    assert every[~on].abs().min() > 0  # the whole row's prompt positions hold real log-probs
    for mine, theirs in zip(response_grads, every_grads):
        assert torch.allclose(mine, theirs, atol=1e-6, rtol=1e-4)
    # A rank with nothing left predicts at one position, so that its output projection still runs.
    assert pack([], packed).predicting.tolist() == [0]


@pytest.mark.parametrize("option", ["softcap", "s_aux", "sliding_window"])
def test_varlen_refuses_attention_options_it_does_not_apply(option):
    from learners.attention import varlen_attention

    query = torch.zeros(1, 2, 3, 8)
    inputs = segments(None, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match=f"does not apply {option}"):
        varlen_attention(None, query, query, query, None, **inputs, **{option: 4})
    output, _ = varlen_attention(None, query, query, query, None, **inputs, **{option: None})
    assert output.shape == (1, 3, 2, 8)


def _groups_of(prompt_lengths: list[int], answers: list[list[int]]) -> list[Rollout]:
    """Rollouts to prompts of these lengths, each with answers of these lengths (random ids, seeded)."""
    rng = random.Random(5)
    out = []
    for g, (length, lengths) in enumerate(zip(prompt_lengths, answers)):
        prompt = [rng.randrange(1, 1000) for _ in range(length)]
        for i, n in enumerate(lengths):
            out.append(
                Rollout(
                    rollout_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    group_size=len(lengths),
                    prompt_index=g,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(1, 1000) for _ in range(n)],
                    logprobs=[-rng.random() for _ in range(n)],
                    versions=[0] * n,
                    reward=float(i % 2),
                    finish_reason="stop",
                    generator_id="gen",
                    created_s=0.0,
                )
            )
    return out


def test_a_shared_prompt_row_holds_each_prompt_once_and_each_rollout_sees_the_whole_prompt():
    """learner.share_prompts: two groups (prompts of 5 and 1 tokens), interleaved as a step may hand them over."""
    rollouts = _groups_of([5, 1], [[2, 3], [4]])
    rollouts = [rollouts[0], rollouts[2], rollouts[1]]  # a, c (the other prompt), b
    batch = pack(rollouts, packed=True, advantages=[1.0, 2.0, 3.0], shared=True)
    a, c, b = rollouts
    p = a.prompt_ids
    # the first prompt's tokens but its last once, then per rollout that last token and its answer
    expect = [*p[:4], p[4], *a.response_ids, p[4], *b.response_ids, *c.prompt_ids, *c.response_ids]
    assert batch.ids[0].tolist() == expect
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    # each response token is predicted from the position before it, the first from the prompt's last token
    predicted = batch.targets.view(-1)[batch.predicting].tolist()
    assert predicted == [*a.response_ids, *c.response_ids, *b.response_ids]  # in the rollouts' order
    assert batch.predicting.tolist() == [4, 5, 11, 12, 13, 14, 7, 8, 9]
    assert batch.advantages.view(-1)[batch.predicting].tolist() == [1.0] * 2 + [2.0] * 4 + [3.0] * 3
    assert batch.owner[0].tolist() == [0] * 7 + [2] * 4 + [1] * 5
    query_starts, key_starts, key_index = batch.prefix
    assert query_starts.tolist() == [0, 4, 7, 11, 16]  # the shared tokens, a's, b's, then c's own (no shared part)
    spans = [key_index[s:e].tolist() for s, e in zip(key_starts.tolist(), key_starts.tolist()[1:])]
    assert spans == [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    values = [torch.arange(len(r.response_ids), dtype=torch.float32) + 10 * i for i, r in enumerate(rollouts)]
    laid = place(rollouts, True, values, shared=True)
    assert [v.tolist() for v in response_values(laid, rollouts, True, shared=True)] == [v.tolist() for v in values]


def test_shared_prompt_micro_batches_keep_a_prompts_group_together_and_count_its_prompt_once():
    from learners.packing import shared_microbatches

    rollouts = _groups_of([10, 10, 10], [[5, 5, 5], [5, 5], [5]])
    # a group costs 9 shared tokens and 6 per rollout: 27, 21 and 15 tokens
    assert shared_microbatches(rollouts, 48) == [[0, 1, 2, 3, 4], [5]]
    assert shared_microbatches(rollouts, 30) == [[0, 1, 2], [3, 4], [5]]
    # a group larger than the budget is cut, each part paying for the prompt again
    assert shared_microbatches(rollouts, 20) == [[0], [1], [2], [3], [4], [5]]


def test_shared_prompt_rows_under_varlen_give_the_log_probs_and_gradients_of_packed_rows():
    """The same forward and backward with each prompt once: every response token's log-prob and the weights'
    gradients must be what rows holding every prompt in full give (float32 on CPU, sdpa per span)."""
    model, policy = tiny_policy()
    model.set_attn_implementation("varlen")
    rollouts = _groups_of([37, 120, 1, 64], [[9, 30, 1], [3, 3], [5, 2], [20, 61, 7, 4]])
    rollouts = rollouts[::2] + rollouts[1::2]  # a group's members need not stand together
    results = {}
    for shared in (False, True):
        model.zero_grad()
        batch = pack(rollouts, True, [float(i) for i in range(len(rollouts))], shared=shared)
        values, entropy = policy(batch.ids, None, batch.targets, 0.9, batch.position_ids, **batch.logprob_options())
        (values * batch.advantages * batch.mask).sum().backward()
        per_rollout = response_values(values.detach(), rollouts, True, shared=shared)
        grads = [p.grad.clone() for p in (model.model.layers[0].self_attn.k_proj.weight, model.lm_head.weight)]
        results[shared] = torch.cat(per_rollout), grads, batch.ids.numel()
    (unshared, unshared_grads, full), (mine, my_grads, tokens) = results[False], results[True]
    assert tokens == 36 + 119 + 0 + 63 + sum(1 + len(r.response_ids) for r in rollouts)
    assert tokens < full / 2
    assert (mine - unshared).abs().max() < 1e-4
    for a, b in zip(my_grads, unshared_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_prompts_are_shared_where_rows_are_packed_under_varlen_and_the_kernel_aligns_spans(monkeypatch):
    import learners.attention
    from asyncrl.config import LearnerConfig
    from learners.models import prompts_shared

    packed = {"pack_sequences": True, "attn_implementation": "varlen"}
    assert prompts_shared(LearnerConfig(**packed)) is True
    assert prompts_shared(LearnerConfig(**packed, share_prompts=False)) is False
    assert prompts_shared(LearnerConfig(pack_sequences=False)) is False
    with pytest.raises(ValueError, match="learner.share_prompts: true needs packed rows"):
        prompts_shared(LearnerConfig(pack_sequences=False, share_prompts=True))
    # a kernel that aligns a short span otherwise: auto keeps prompts whole, true says why it cannot
    monkeypatch.setattr(learners.attention, "shared_spans_unavailable", lambda: "misaligned")
    assert prompts_shared(LearnerConfig(**packed)) is False
    with pytest.raises(ValueError, match="learner.share_prompts: misaligned"):
        prompts_shared(LearnerConfig(**packed, share_prompts=True))
