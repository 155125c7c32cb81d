"""Run by test_learner_group.py under torchrun: a 2-rank ZeRO-3 engine on gloo.

Writes one JSON file per rank with what the test asserts on.
"""

import json
import os
import sys

import torch

from asyncrl.config import LearnerConfig, ModelConfig
from learners.engine import build_engine, gathered_parameters, init_distributed


def main(model_path: str, out_dir: str) -> None:
    rank, world = init_distributed()
    torch.manual_seed(0)
    engine, model = build_engine(LearnerConfig(lr=3e-3, zero_stage=3), ModelConfig(path=model_path), 5)
    shards = {n: p.ds_tensor.numel() for n, p in model.named_parameters()}
    full = {n: p.ds_numel for n, p in model.named_parameters()}
    initial = {n: t for n, t in gathered_parameters(model, bucket_bytes=4096)}
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(15):
        logprobs, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
        loss = -logprobs.mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    exported = dict(gathered_parameters(model, bucket_bytes=4096))
    result = {
        "rank": rank, "world": world, "losses": losses,
        "shard_numel": sum(shards.values()), "full_numel": sum(full.values()),
        "initial_sum": {n: float(t.double().sum()) for n, t in initial.items()},
        "exported_sum": {n: float(t.double().sum()) for n, t in exported.items()},
    }
    with torch.no_grad():  # a ZeRO-3 forward is collective: every rank runs it
        engine.eval()
        lp_engine, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    if rank == 0:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(model_path)
        result["initial_equals_checkpoint"] = all(
            torch.equal(initial[n], p) for n, p in reference.state_dict().items())
        reference.load_state_dict(exported)
        with torch.no_grad():
            ref = torch.log_softmax(reference(ids).logits.float(), -1)
            lp_ref = ref.gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1)).squeeze(-1)
        result["export_logprob_diff"] = float((lp_engine - lp_ref).abs().max())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
