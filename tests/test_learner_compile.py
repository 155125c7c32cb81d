"""``learner.compile``: the policy's decoder layers compiled once, before the first batch, and the same step."""

import pytest
import torch
from conftest import rollouts_of_lengths

from asyncrl.config import load_config


def test_compile_is_refused_where_zero3_would_partition_the_layers():
    with pytest.raises(ValueError, match=r"learner\.compile"):
        load_config("configs/quickstart.yaml", ["--learner.compile=true", "--learner.ranks=2"])
    with pytest.raises(ValueError, match=r"learner\.compile"):
        load_config("configs/quickstart.yaml", ["--learner.compile=true", "--learner.zero_stage=3"])
    assert load_config(
        "configs/quickstart.yaml", ["--learner.compile=true", "--learner.ranks=2", "--learner.zero_stage=2"]
    )


def learner(compiled: bool, layout: list[str]):
    from learners.engine import build_engine, init_distributed
    from learners.ranks import Ranks
    from learners.step import PolicyStep

    init_distributed()
    config = load_config("configs/quickstart.yaml", [f"--learner.compile={str(compiled).lower()}", *layout])
    torch.manual_seed(0)
    engine, model = build_engine(config.learner, config.model, logprob_chunk_tokens=64)
    return PolicyStep(config, engine, Ranks(0, 1, None)), model


def batch(response_lengths: list[int]) -> list:
    rollouts = rollouts_of_lengths([(5, n) for n in response_lengths])
    for i, rollout in enumerate(rollouts):  # tiny Llama's 14-token vocabulary; two groups, rewards 0 and 1
        rollout.prompt_ids = [t % 11 + 3 for t in rollout.prompt_ids]
        rollout.response_ids = [t % 11 + 3 for t in rollout.response_ids]
        rollout.logprobs = [-2.0] * len(rollout.response_ids)
        rollout.group_id, rollout.group_size, rollout.reward = f"g{i % 2}", len(rollouts) // 2, float(i % 3 == 0)
    return rollouts


PADDED = ["--learner.pack_sequences=false"]
PACKED = ["--learner.pack_sequences=true", "--learner.attn_implementation=varlen", "--learner.share_prompts=true"]


@pytest.mark.parametrize("layout", [PADDED, PACKED], ids=["padded", "packed-varlen"])
def test_compiled_layers_compile_once_before_the_first_step_and_train_as_the_eager_ones(layout):
    from torch._dynamo.utils import counters

    eager, eager_model = learner(False, layout)
    compiled, compiled_model = learner(True, layout)
    before = counters["stats"]["unique_graphs"]
    assert compiled.compile_now() > 0
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > before  # the warm-up compiled the layers' forward (and the backward with it)
    for lengths in ([3, 4, 2, 4], [4, 1, 3, 2, 4, 3], [2, 2, 4, 4]):  # other lengths and row counts every step
        expected, got = eager.run(batch(lengths), []), compiled.run(batch(lengths), [])
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-3)
    # one graph served every step's shapes: nothing was compiled after the warm-up
    assert counters["stats"]["unique_graphs"] == graphs
    # the warm-up changed neither the weights nor the optimizer: after three steps both models agree
    for (name, a), b in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
