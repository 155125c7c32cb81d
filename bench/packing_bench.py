"""Sequence packing vs padding in the learner: same rollouts, same engine, side by side.

Rollouts with a spread of response lengths (as RL produces) go through the
learner's own micro-batching, input packing and forward/backward/step, once
padded (one row per rollout) and once packed (rollouts back to back, attention
kept within each). Reports real (unpadded) tokens per second, the share of
computed positions that were padding, and micro-batches per step.

    python bench/packing_bench.py --zero-stage 3 --out bench/results/packing_cpu.json
    python bench/packing_bench.py --model 0.5b --rollouts 256 --prompt-len 256 --max-response 1024 \
        --budget 65536 --out bench/results/packing_gpu.json

``--every-position`` runs each mode a second time with the log-prob tail (output projection,
log-softmax) over every position, as the learner did before it kept to the positions that predict a
response token; each mode's record then stands beside its every-position run.

Each mode gets its own learner: padded rows under transformers' default
attention (sdpa), and packed rows under each of ``--packed-attention``
(comma-separated; default on a GPU: ``varlen,flex_attention``; on CPU sdpa,
where neither kernel exists). ``--model 0.5b`` is a random-init Qwen2-0.5B
shape and ``--model 135m`` SmolLM2-135M's, in the hardware's dtype (bf16 on a GPU).
Each mode's real tokens/s over its timed steps (packed beside padded) and the
padding share are appended to ``bench/records/packing_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import records  # noqa: E402
from bench.provenance import head_commit, machine, short_commit, short_machine, versions_of  # noqa: E402


def rollouts(count: int, prompt_len: int, max_response: int, seed: int = 0):
    from asyncrl.wire.protocol import Rollout

    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(max_response // 8, max_response)  # RL responses: mostly short, some long
        out.append(
            Rollout(
                rollout_id=f"r{i}",
                group_id=f"g{i // 8}",
                group_size=8,
                prompt_index=i,
                prompt_ids=[rng.randint(3, 500) for _ in range(prompt_len)],
                response_ids=[rng.randint(3, 500) for _ in range(n)],
                logprobs=[-1.0] * n,
                versions=[0] * n,
                reward=rng.random(),
                finish_reason="stop",
                generator_id="bench",
                created_s=0.0,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--budget", type=int, default=4096, help="learner.max_tokens_per_microbatch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=("tiny", "135m", "0.5b"), default="tiny")
    parser.add_argument("--packed-attention", help="learner.attn_implementation for packed rows, comma-separated")
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 3),
        default=None,
        help="learner.zero_stage (unset: none for one rank; results/packing_cpu.json used 3)",
    )
    parser.add_argument(
        "--every-position",
        action="store_true",
        help="also run each mode with log-probs at every position (prompts too), beside the response positions",
    )
    parser.add_argument("--out", default="bench/results/packing_cpu.json")
    parser.add_argument("--commit", help="the commit to record (default: the checkout's)")
    records.add_argument(parser, "packing_bench")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, Qwen2Config

    if not torch.cuda.is_available():  # before DeepSpeed picks its accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from asyncrl.config import LearnerConfig, ModelConfig
    from learners.advantages import expand_to_tokens, grpo
    from learners.engine import build_engine, init_distributed
    from learners.packing import microbatches, pack
    from learners.policy_loss import PolicyLossConfig, policy_loss

    folder = tempfile.mkdtemp(prefix="asyncrl-packing-")
    if args.model == "tiny":
        LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=512,
            max_position_embeddings=4096,
        ).save_pretrained(folder)
    elif args.model == "135m":
        LlamaConfig(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ).save_pretrained(folder)
    else:
        Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ).save_pretrained(folder)
    init_distributed()
    packed_attention = args.packed_attention or ("varlen,flex_attention" if torch.cuda.is_available() else "sdpa")
    modes = {"padded": None, **{f"packed_{name}": name for name in packed_attention.split(",")}}
    engines = {
        mode: build_engine(
            LearnerConfig(
                lr=1e-5, zero_stage=args.zero_stage, pack_sequences=bool(attention), attn_implementation=attention
            ),
            ModelConfig(path=folder, random_init=True),
        )[0]
        for mode, attention in modes.items()
    }
    batch = rollouts(args.rollouts, args.prompt_len, args.max_response)
    advantages = expand_to_tokens(
        grpo([r.reward for r in batch], [r.group_id for r in batch]), [len(r.response_ids) for r in batch]
    )
    real_tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in batch)
    results = {
        "machine": machine(torch.cuda.is_available()),
        "versions": versions_of(),
        "commit": args.commit or head_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "model": {"tiny": "Llama 4 layers, hidden 256", "135m": "SmolLM2-135M shape", "0.5b": "Qwen2 0.5B shape"}[
            args.model
        ],
        "attention": {mode: engine.module.model.config._attn_implementation for mode, engine in engines.items()},
        "rollouts": args.rollouts,
        "prompt_len": args.prompt_len,
        "max_response": args.max_response,
        "real_tokens": real_tokens,
        "budget": args.budget,
        "runs": {},
    }

    def step(name: str) -> tuple[float, int, int]:
        mode, every = name.removesuffix(EVERY), name.endswith(EVERY)
        engine, packed = engines[mode], bool(modes[mode])
        micro = microbatches([len(r.prompt_ids) + len(r.response_ids) for r in batch], args.budget, packed)
        computed = 0
        started = time.perf_counter()
        for k, rows in enumerate(micro):
            rollouts_in = [batch[i] for i in rows]
            ids, attention, positions, targets, behaviour, mask, adv, predicting = pack(
                rollouts_in, packed, [advantages[i] for i in rows]
            ).to(engine.device)[:8]
            wanted = None if every else predicting
            computed += ids.numel()
            engine.set_gradient_accumulation_boundary(k == len(micro) - 1)
            logprobs, _ = engine(ids, attention, targets, 1.0, positions, predicting=wanted)
            n = float(mask.sum())
            loss = policy_loss(logprobs, behaviour, adv, mask, PolicyLossConfig(), num_tokens=n, num_sequences=1).loss
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - started, computed, len(micro)

    names = [*modes, *([f"{mode}{EVERY}" for mode in modes] if args.every_position else [])]
    warmup_s = {}
    for name in names:  # warm-up each (compiles kernels, if any)
        warmup_s[name] = step(name)[0]
        print(f"{name} warm-up step: {warmup_s[name]:.1f} s", flush=True)
    for name in names:
        times, computed, count = [], 0, 0
        for _ in range(args.steps):
            seconds, computed, count = step(name)
            times.append(seconds)
        best = min(times)
        results["runs"][name] = {
            "warmup_step_s": warmup_s[name],
            "step_s": times,
            "real_tokens_per_s": real_tokens / best,
            "padding_share": 1 - real_tokens / computed,
            "microbatches": count,
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
    runs = results["runs"]
    results["speedup"] = {
        name: runs[name]["real_tokens_per_s"] / runs["padded"]["real_tokens_per_s"]
        for name in modes
        if name != "padded"
    }  # packed / padded, by real tokens per second
    if args.every_position:  # response positions / every position, by real tokens per second
        results["speedup_of_response_positions"] = {
            name: runs[name]["real_tokens_per_s"] / runs[f"{name}{EVERY}"]["real_tokens_per_s"] for name in modes
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    for name, ratio in results["speedup"].items():
        print(f"{name} / padded: {ratio:.2f}x")
    for name, ratio in results.get("speedup_of_response_positions", {}).items():
        print(f"{name}, response positions / every position: {ratio:.2f}x")
    at = records.Stamp(
        commit=(args.commit or short_commit())[:7],
        date=results["date"],
        machine=short_machine(torch.cuda.is_available()),
    )
    records.write(args.records, records_of(results, at))


EVERY = "_every_position"  # a mode's run with log-probs at every position (--every-position)


def records_of(results: dict, at: records.Stamp) -> list[records.Record]:
    """Real tokens/s of each mode over its timed steps (packed modes beside padded rows; with --every-position,
    each mode beside its run with log-probs at every position, which is recorded too), and the padding share."""
    settings = {key: results[key] for key in ("rollouts", "prompt_len", "max_response", "real_tokens", "budget")}
    settings["attention"] = results.get("attention")
    case = f"{results['model']}, {results['rollouts']} rollouts"
    if any(mode.endswith(EVERY) for mode in results["runs"]):  # the lengths decide what the prompts' share saves
        case += f" (prompts {results['prompt_len']}, responses up to {results['max_response']})"
    runs = results["runs"]

    def rates(mode: str) -> list[float]:
        return [results["real_tokens"] / seconds for seconds in runs[mode]["step_s"]]

    def baseline(mode: str) -> records.Peer | None:
        if mode.endswith(EVERY):
            return None
        if f"{mode}{EVERY}" in runs:
            return records.peer("log-probs at every position", rates(f"{mode}{EVERY}"))
        return None if mode == "padded" else records.peer("padded", rates("padded"))

    out = [
        records.measure(
            at,
            bench="packing_bench",
            case=case,
            metric=f"{mode}_tokens_per_s",
            unit="tokens/s",
            repeats=rates(mode),
            vs=baseline(mode),
            settings=settings,
        )
        for mode in runs
    ]
    out.append(
        records.measure(
            at,
            bench="packing_bench",
            case=case,
            metric="padding_share",
            unit="of padded positions",
            repeats=[runs["padded"]["padding_share"]],
            higher_is_better=False,
            settings=settings,
        )
    )
    return out


if __name__ == "__main__":
    main()
