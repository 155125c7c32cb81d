"""Learner throughput: asyncrl's ZeRO-3 engine against torch FSDP2, same model, data and loss.

Run under torchrun, one process per GPU; each run appends one JSON line per
(sequence length) to ``--out``:

    torchrun --nproc_per_node 2 bench/learner_bench.py --impl zero3 --model 1.5b --seq 4096 16384 --out r.jsonl

Models are random-init with Qwen2 shapes (no hub). Both sides train with bf16
compute, fp32 master weights and gradient reduction, fused AdamW, activation
checkpointing and asyncrl's chunked log-prob loss, so the only difference is
the sharding engine. ``--impl zero3-naive`` is DeepSpeed ZeRO-3 with its
default buckets and no prefetch tuning, for the "what tuning bought" column.
``--impl asyncrl`` is the learner as a run builds it on this many GPUs (ZeRO-3
on several, no ZeRO on one). ``--no-checkpointing`` turns activation
checkpointing off on every side; ``--liger`` gives every side Liger's kernels
(``learner.liger_kernels``); ``--accumulate N`` runs N micro-batches per
optimizer step, as an RL step over many rollouts does. ``--logprobs autograd``
computes each chunk's log-probs with separate float32 ops under autograd (what
the learner runs on CPU, and ran on GPUs before its fused log-prob function), on every side. On one GPU both sides
then do the same work; on several, FSDP2 skips its reduce-scatter until the
last micro-batch (holding unsharded gradients meanwhile) while ZeRO-3 reduces
after each one, so compare those runs with that in mind.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import head_commit  # noqa: E402

SHAPES = {  # Qwen2 0.5B and 1.5B
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16


def model_folder(name: str, max_seq: int) -> str:
    from transformers import Qwen2Config

    folder = os.path.join(tempfile.gettempdir(), f"asyncrl-bench-{name}-{max_seq}")
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        Qwen2Config(**SHAPES[name], max_position_embeddings=max_seq, rope_theta=1e6).save_pretrained(folder)
    dist.barrier()
    return folder


def dense_params(config) -> int:
    """Parameters that take part in a matmul per token (the lm head included, tied or not)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head = h // config.num_attention_heads
    kv = config.num_key_value_heads * head
    attn = h * h * 2 + h * kv * 2  # q, o, k, v
    mlp = 3 * h * i
    return layers * (attn + mlp) + config.vocab_size * h  # lm head matmul (tied or not, it is computed)


def build_deepspeed(
    folder: str,
    naive: bool,
    chunk: int,
    bucket_elements: int,
    persistence: int,
    granularity: int = 0,
    allreduce_fetch: bool = False,
    stage: int | None = 3,
    checkpointing: bool = True,
    liger: bool = False,
):
    from asyncrl.config import LearnerConfig, ModelConfig
    from learners.engine import build_engine

    learner = LearnerConfig(
        lr=1e-5,
        zero_stage=stage,
        gradient_checkpointing=checkpointing,
        torch_threads=1,
        zero_bucket_elements=bucket_elements,
        zero_persistence_threshold=persistence,
        zero_module_granularity=granularity,
        zero_allreduce_fetch=allreduce_fetch,
        liger_kernels=liger,
        pack_sequences=False,
    )  # one sequence a row, sdpa, as FSDP2's loop
    if naive:
        path = os.path.join(tempfile.gettempdir(), "asyncrl-naive-ds.json")
        with open(path, "w") as f:
            json.dump(
                {
                    "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 1,
                    "gradient_clipping": 1.0,
                    "bf16": {"enabled": True},
                    "zero_optimization": {"stage": 3},
                    "steps_per_print": 10**9,
                },
                f,
            )
        learner = LearnerConfig(
            lr=1e-5,
            zero_stage=3,
            gradient_checkpointing=checkpointing,
            deepspeed_config=path,
            liger_kernels=liger,
            pack_sequences=False,
        )
    engine, model = build_engine(learner, ModelConfig(path=folder, dtype="bfloat16", random_init=True), chunk)

    def step(ids: torch.Tensor, accumulate: int = 1) -> torch.Tensor:
        for k in range(accumulate):  # as the learner does: one optimizer step at the last micro-batch
            engine.set_gradient_accumulation_boundary(k == accumulate - 1)
            logprobs, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
            loss = -logprobs.float().mean()
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        return loss

    return step, model.config, engine


def build_fsdp2(folder: str, chunk: int, checkpointing: bool = True, liger: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from learners.engine import PolicyLogprobs
    from learners.models import apply_liger

    config = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if liger:
        apply_liger(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    wrapper = PolicyLogprobs(model, chunk)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(wrapper, mp_policy=policy)  # the root whose forward runs everything, as with ZeRO-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(ids: torch.Tensor, accumulate: int = 1) -> torch.Tensor:
        for k in range(accumulate):
            wrapper.set_requires_gradient_sync(k == accumulate - 1)  # reduce-scatter once, at the last
            logprobs, _ = wrapper(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
            loss = -logprobs.float().mean()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, config, model


def autograd_chunk_logprobs(lm_head, hidden, targets, temperature, entropy_grad=False):
    """One chunk's log-probs and entropy as separate float32 ops, differentiated by autograd, on a GPU too."""
    from learners.loss import autograd_logprobs

    return autograd_logprobs(lm_head(hidden), targets, temperature, entropy_grad)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["asyncrl", "zero3", "zero3-naive", "fsdp2"], required=True)
    parser.add_argument("--model", choices=sorted(SHAPES), required=True)
    parser.add_argument("--seq", type=int, nargs="+", required=True)
    parser.add_argument("--tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--bucket-elements", type=int, default=500_000_000, help="zero3: learner.zero_bucket_elements")
    parser.add_argument("--persistence", type=int, default=1_000_000, help="zero3: learner.zero_persistence_threshold")
    parser.add_argument("--granularity", type=int, default=0, help="zero3: learner.zero_module_granularity")
    parser.add_argument("--allreduce-fetch", action="store_true", help="zero3: learner.zero_allreduce_fetch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (>= 1)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--liger", action="store_true", help="Liger's kernels on every side")
    parser.add_argument(
        "--logprobs",
        choices=["fused", "autograd"],
        default="fused",
        help="each chunk's log-prob tail: the learner's fused function, or plain ops under autograd",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", help="the commit to record (default: the checkout's)")
    args = parser.parse_args()
    if args.logprobs == "autograd":
        import learners.loss

        learners.loss._chunk_logprobs = autograd_chunk_logprobs
    if args.accumulate < 1:
        parser.error("--accumulate must be at least 1")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if args.impl == "fsdp2":
        dist.init_process_group("nccl")
    else:
        from learners.engine import init_distributed

        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    commit = args.commit or head_commit() or None
    folder = model_folder(args.model, max(args.seq))
    started = time.time()
    if args.impl == "fsdp2":
        step, config, holder = build_fsdp2(folder, args.chunk, args.checkpointing, args.liger)
    else:
        step, config, holder = build_deepspeed(
            folder,
            args.impl == "zero3-naive",
            args.chunk,
            args.bucket_elements,
            args.persistence,
            args.granularity,
            args.allreduce_fetch,
            stage=None if args.impl == "asyncrl" else 3,
            checkpointing=args.checkpointing,
            liger=args.liger,
        )
    build_s = time.time() - started
    generator = torch.Generator(device="cuda").manual_seed(rank)
    for seq in args.seq:
        batch = max(1, args.tokens_per_gpu // seq)
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=generator)
        torch.cuda.reset_peak_memory_stats()
        record = dict(
            impl=args.impl,
            model=args.model,
            seq=seq,
            batch_per_gpu=batch,
            gpus=world,
            checkpointing=args.checkpointing,
            liger=args.liger,
            accumulate=args.accumulate,
            logprobs=args.logprobs,
            commit=commit,
        )
        if args.impl != "fsdp2":
            record["zero_stage"] = holder.zero_optimization_stage()
        if args.impl == "zero3":
            record.update(
                bucket_elements=args.bucket_elements,
                persistence=args.persistence,
                granularity=args.granularity,
                allreduce_fetch=args.allreduce_fetch,
            )
        try:
            for _ in range(args.warmup):
                step(ids, args.accumulate)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = step(ids, args.accumulate)
            torch.cuda.synchronize()
            elapsed = (time.perf_counter() - t0) / args.steps
            tokens = batch * seq * args.accumulate
            flops = 6 * dense_params(config) + 6 * config.num_hidden_layers * config.hidden_size * seq
            record.update(
                step_s=elapsed,
                tokens_per_s_per_gpu=tokens / elapsed,
                mfu=tokens / elapsed * flops / PEAK_BF16_FLOPS,
                peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
                loss=float(loss),
                build_s=build_s,
            )
        except torch.OutOfMemoryError as exc:
            record.update(oom=True, error=str(exc).splitlines()[0])
            gc.collect()
            torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(record), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
