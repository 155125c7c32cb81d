"""What the generator samples from a model, beside what plain vLLM samples with TRL's engine settings.

Both sides sample the same training prompts of a config (its chat template applied as TRL
applies it), ``samples_per_prompt`` answers each, at the config's sampling settings and the same seed:
asyncrl's ``VllmBackend`` (one request of n samples per prompt, its engine settings) and a plain
``vllm.LLM`` as TRL's colocated mode builds it (each prompt repeated n times, ``max_num_batched_tokens``
4096). Each side runs in its own process. The report gives each side's answer length, truncated share,
reward, the reward of truncated and of finished answers, and how many samples are token for token the same.

    python bench/sampler_parity.py configs/arith-smollm2.yaml --prompts 96 --seed 7 \\
      --out bench/results/sampler_parity_cpu.json

On a CPU, ``--dtype float32`` (vLLM's CPU build) and ``--kv-cache-bytes`` size the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import provenance  # noqa: E402


def sample(args: argparse.Namespace) -> list[dict]:
    """One side's samples: prompt number, tokens, finish reason and reward."""
    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.tasks import reward_function
    from asyncrl.tasks.data import load_task_data

    config = load_config(args.config)
    gen, items = config.generator, load_task_data(config.task).items
    score = reward_function(config.task)
    model = str(ROOT / config.model.path)  # an absolute path stays as it is
    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen = random.Random(args.seed).sample(range(len(items)), args.prompts)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": items[i]["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for i in chosen
    ]
    engine = {"dtype": args.dtype, "enforce_eager": args.eager, "seed": args.seed}
    if args.kv_cache_bytes:
        engine["kv_cache_memory_bytes"] = args.kv_cache_bytes
    out = []
    if args.side == "asyncrl":
        from generators.base import GenerationRequest, SamplingParams
        from generators.vllm_backend import VllmBackend

        backend = VllmBackend(model, **engine)
        requests = [GenerationRequest(str(k), p) for k, p in enumerate(prompts)]
        params = SamplingParams(gen.samples_per_prompt, gen.max_new_tokens, gen.temperature, gen.top_p)
        for request, samples in backend.generate(requests, params):
            out += [(int(request.request_id), s.token_ids, s.text, s.finish_reason) for s in samples]
    else:
        from vllm import LLM
        from vllm import SamplingParams as VllmSamplingParams

        llm = LLM(model=model, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", **engine)
        params = VllmSamplingParams(
            n=1, temperature=gen.temperature, top_p=gen.top_p, top_k=0, max_tokens=gen.max_new_tokens, logprobs=0
        )
        repeated = [{"prompt_token_ids": p} for p in prompts for _ in range(gen.samples_per_prompt)]
        for k, result in enumerate(llm.generate(repeated, params, use_tqdm=False)):
            c = result.outputs[0]
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            out.append(
                (
                    k // gen.samples_per_prompt,
                    list(c.token_ids),
                    text,
                    "length" if c.finish_reason == "length" else "stop",
                )
            )
    return [
        {"prompt": p, "tokens": list(t), "finish": f, "reward": float(score(text, items[chosen[p]]))}
        for p, t, text, f in out
    ]


def summary(rows: list[dict]) -> dict:
    cut = [r for r in rows if r["finish"] == "length"]
    done = [r for r in rows if r["finish"] != "length"]
    return {
        "samples": len(rows),
        "answer_tokens_mean": sum(len(r["tokens"]) for r in rows) / len(rows),
        "truncated_share": len(cut) / len(rows),
        "reward_mean": sum(r["reward"] for r in rows) / len(rows),
        "reward_truncated": [sum(r["reward"] for r in cut), len(cut)],
        "reward_finished": [sum(r["reward"] for r in done), len(done)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (vLLM's CPU build needs it)")
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--side", choices=["asyncrl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        args.samples.write_text(json.dumps(sample(args)))
        return
    sides = {}
    with tempfile.TemporaryDirectory() as work:
        for side in ("asyncrl", "trl"):
            path = Path(work) / f"{side}.json"
            env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # both engines in their process, as TRL's
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--side", side, "--samples", str(path)], check=True, env=env
            )
            sides[side] = sorted(json.loads(path.read_text()), key=lambda r: (r["prompt"], r["tokens"]))
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(sides["asyncrl"], sides["trl"]))
    report = {
        "config": str(args.config),
        "prompts": args.prompts,
        "seed": args.seed,
        "dtype": args.dtype,
        "sides": {side: summary(rows) for side, rows in sides.items()},
        "identical_samples": same,
    }
    provenance.publish(report, args.out)


if __name__ == "__main__":
    main()
