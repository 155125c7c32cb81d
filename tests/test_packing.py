"""Micro-batch inputs (learners.packing) against a plain per-rollout construction."""

import random

import pytest
import torch

from asyncrl.protocol import Rollout
from learners.packing import pack, place


def rollout(rng: random.Random, i: int) -> Rollout:
    p, n = rng.randint(1, 6), rng.randint(1, 5)
    return Rollout(rollout_id=f"r{i}", group_id="g", group_size=1, prompt_index=0,
                   prompt_ids=[rng.randint(1, 50) for _ in range(p)], response_ids=[rng.randint(1, 50) for _ in range(n)],
                   logprobs=[-rng.random() for _ in range(n)], versions=[0] * n, reward=0.0, finish_reason="length",
                   generator_id="x", created_s=0.0, generate_s=0.0)


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
        ids[row, off:off + p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        attention[row, off:off + p + n] = 1
        positions[row, off:off + p + n] = torch.arange(p + n)
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
    advantages = ([torch.randn(len(r.response_ids)) for r in rollouts] if per_token
                  else [float(rng.gauss(0, 1)) for _ in rollouts])
    got = pack(rollouts, packed, advantages)
    ids, attention, positions, targets, behaviour, mask, adv = reference(rollouts, packed, advantages)
    assert torch.equal(got[0], ids) and torch.equal(got[3], targets)
    assert torch.equal(got[5], mask) and torch.allclose(got[4], behaviour) and torch.allclose(got[6], adv)
    if packed:
        assert got[1] is None and torch.equal(got[2], positions)
    else:
        assert got[2] is None and torch.equal(got[1], attention)
    assert torch.allclose(place(rollouts, packed, advantages), adv)


def test_an_empty_micro_batch_is_one_masked_row():
    ids, attention, positions, targets, behaviour, mask, adv = pack([], False, [])
    assert ids.shape == (1, 2) and attention.sum() == 2 and mask.sum() == 0 and adv.sum() == 0
