"""The generator at its defaults against plain ``vllm.LLM`` at vLLM's defaults: tokens/s, same prompts, same GPU.

    python bench/generator_vs_vllm.py --model 0.5b --out bench/results/generator_vs_vllm.json

Each side runs in its own process, one after the other (each engine gets the
whole GPU, as vLLM's defaults assume): plain ``vllm.LLM(model)`` with
nothing changed, and asyncrl's vLLM backend opened from a config that sets
nothing under ``generator.vllm`` (so the hardware decides: bf16, CUDA graphs,
prefix caching). The backend generates with an engine-step hook that checks
the clock every step, as a generator does for in-flight weight updates. The
model is a random-init Qwen2 shape (``load_format: dummy``), the prompts
random token ids, and ``ignore_eos`` makes every response
``--new-tokens`` long. Reported: best and median tokens/s over ``--rounds``
after one warm-up, engine start-up time, and the ratio of the bests.

``--sides`` adds variants, each in its own process: ``plain-in-process`` and
``asyncrl-engine-process`` run the engine core in the calling process or in
its own (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``), to tell the engine's
placement apart from the backend's loop; ``plain-in-process-gc`` and ``asyncrl-python-gc`` swap the
garbage-collector thresholds (plain vLLM at the generator's ``generator.gc_thresholds``, the generator at
Python's), to tell what the collector costs apart from the rest. Every side but ``plain`` gets a
ratio against it, and a record beside it in ``bench/records/generator_vs_vllm.jsonl``.
``--passes N`` runs the sides in turn N times, each pass in fresh processes,
and pools each side's rounds: a side that always runs first (or last) on a
machine whose clocks or caches drift would otherwise carry the drift as its own.
``--profile DIR`` runs each side one more round under cProfile and keeps its
busiest Python functions: the engine's work on the GPU is the same on every
side, so what sets them apart shows there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

GC_ENV = "ASYNCRL_BENCH_GC"  # a child side's garbage-collector thresholds (SIDES)


def prompts(batch: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(batch)]


def measure(generate, args: argparse.Namespace) -> dict:
    """Tokens/s of ``generate`` over ``args.rounds`` after a warm-up, and the seconds per round the cyclic
    garbage collector paused this process (which a profile does not show; for ``plain``, whose engine core runs
    in a process of its own, the caller's pauses only); with ``--profile``, one more round under
    cProfile (not timed), its functions by their own time in ``PROFILE/<side>.txt``."""
    import gc

    generate()  # warm-up
    pauses = [0.0, 0]  # seconds in the cyclic garbage collector over the timed rounds, and its full collections
    paused_at = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            paused_at[0] = time.perf_counter()
        else:
            pauses[0] += time.perf_counter() - paused_at[0]
            pauses[1] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    rates = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        tokens = generate()
        rates.append(tokens / (time.perf_counter() - started))
    gc.callbacks.remove(on_gc)
    collector = {
        "gc_s_per_round": pauses[0] / args.rounds,
        "full_collections": pauses[1],
        "frozen": gc.get_freeze_count(),
        "gc_thresholds": list(gc.get_threshold()),
    }
    if args.profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(generate)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        folder = Path(args.profile)
        folder.mkdir(parents=True, exist_ok=True)
        side = "-".join([args.side, os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default")])
        (folder / f"{side}.txt").write_text(text.getvalue())
    return {"tokens_per_s": rates, "best": max(rates), "median": statistics.median(rates), **collector}


def plain_side(folder: str, args: argparse.Namespace) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM's defaults on a GPU; on CPU (a dry run of this script) vLLM cannot size its cache itself.
    cpu = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}
    started = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", skip_tokenizer_init=True, **cpu)
    start_s = time.perf_counter() - started
    if os.environ.get(GC_ENV) == "generator":
        from asyncrl.config.sections import GeneratorConfig
        from generators import set_gc_thresholds

        set_gc_thresholds(GeneratorConfig().gc_thresholds)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, logprobs=0)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.batch, args.prompt_len)]

    def generate() -> int:
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False))

    return {"engine_start_s": start_s, **engine_facts(llm), **measure(generate, args)}


def asyncrl_side(folder: str, args: argparse.Namespace) -> dict:
    from asyncrl.config import load_config
    from generators import open_backend, vllm_engine_args
    from generators.base import GenerationRequest, SamplingParams

    python_gc = ["--generator.gc_thresholds=null"] if os.environ.get(GC_ENV) == "python" else []
    config = load_config(
        None,
        [
            f"--model.path={folder}",
            "--generator.backend=vllm",
            "--generator.vllm.engine_args={load_format: dummy}",
            *python_gc,
        ],
    )
    started = time.perf_counter()
    backend = open_backend(config)
    start_s = time.perf_counter() - started
    backend.ignore_eos = True
    params = SamplingParams(n=1, max_new_tokens=args.new_tokens, temperature=1.0)
    batch = prompts(args.batch, args.prompt_len)
    import zmq

    watch = zmq.Context.instance().socket(zmq.REQ)  # held for a version that never comes, as in a run between two

    def between_steps() -> None:  # what a generator does between engine steps when no update has come
        watch.poll(0)

    def generate() -> int:
        requests = [GenerationRequest(f"p{i}", p) for i, p in enumerate(batch)]
        return sum(
            len(s.token_ids) for _, samples in backend.generate(requests, params, between_steps) for s in samples
        )

    return {
        "engine_start_s": start_s,
        "engine_args": {k: v for k, v in vllm_engine_args(config).items()},
        **engine_facts(backend.llm),
        **measure(generate, args),
    }


# side name -> (function, VLLM_ENABLE_V1_MULTIPROCESSING it runs under, garbage-collector thresholds); None:
# each side's own default (Python's for plain vLLM, generator.gc_thresholds for asyncrl)
SIDES = {
    "plain": ("plain", None, None),
    "plain-in-process": ("plain", "0", None),
    "plain-in-process-gc": ("plain", "0", "generator"),  # with the thresholds the generator sets
    "asyncrl": ("asyncrl", None, None),
    "asyncrl-engine-process": ("asyncrl", "1", None),
    "asyncrl-python-gc": ("asyncrl", None, "python"),  # the generator at Python's thresholds
}


def engine_facts(llm: Any) -> dict:
    """What vLLM chose for the engine: whether its core runs in this process and schedules asynchronously,
    and its KV cache in tokens (None where the engine process does not report it back)."""
    from vllm import envs

    config = llm.llm_engine.vllm_config
    blocks = getattr(config.cache_config, "num_gpu_blocks", None)
    return {
        "engine_in_process": not envs.VLLM_ENABLE_V1_MULTIPROCESSING,
        "async_scheduling": getattr(config.scheduler_config, "async_scheduling", None),
        "kv_cache_tokens": blocks * config.cache_config.block_size if blocks else None,
    }


def model_folder(name: str) -> str:
    from bench.push_bench import model_folder as write

    return write(name)


def run_side(side: str, args: argparse.Namespace) -> dict | None:
    """One side in a process of its own; its result, or None (and its output on stderr) if it failed."""
    function, multiprocessing, collector = SIDES[side]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if multiprocessing is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    env[GC_ENV] = collector or "default"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    cmd = [sys.executable, __file__, "--side", function, *sys.argv[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
        return None
    return json.loads(lines[-1].removeprefix("RESULT "))


def pool(earlier: dict | None, result: dict) -> dict:
    """A side's results over its passes: every pass's rounds in ``tokens_per_s``, best and median over all of
    them, each pass's median in ``pass_medians``; the other figures are the latest pass's."""
    if earlier is None:
        return {**result, "pass_medians": [result["median"]]}
    rates = earlier["tokens_per_s"] + result["tokens_per_s"]
    return {
        **result,
        "tokens_per_s": rates,
        "best": max(rates),
        "median": statistics.median(rates),
        "pass_medians": earlier["pass_medians"] + [result["median"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="0.5b")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--passes", type=int, default=1, help="run the sides in turn this many times (A B A B), rounds pooled"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per side")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default="bench/results/generator_vs_vllm.json")
    parser.add_argument(
        "--profile", default=None, help="folder: each side's Python functions over one more round (cProfile)"
    )
    parser.add_argument("--sides", nargs="+", choices=sorted(SIDES), default=["plain", "asyncrl"])
    parser.add_argument("--side", choices=("plain", "asyncrl"), help=argparse.SUPPRESS)  # one side, in a child
    records.add_argument(parser, "generator_vs_vllm")
    args = parser.parse_args()

    if not args.side and "plain" not in args.sides:
        parser.error("--sides must include plain, the baseline")
    folder = model_folder(args.model)
    if args.side:
        result = (plain_side if args.side == "plain" else asyncrl_side)(folder, args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import torch

    sides: dict[str, dict] = {}
    for turn in range(args.passes):
        for side in args.sides:
            result = run_side(side, args)
            if result is None:
                return 1
            print(f"pass {turn + 1}", side, json.dumps({k: v for k, v in result.items() if k != "tokens_per_s"}))
            sides[side] = pool(sides.get(side), result)
    record = {
        "what": __doc__.split("\n")[0],
        "machine": f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}, "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "model": f"random-init Qwen2 {args.model}",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "passes": args.passes,
        "sides": sides,  # plain: plain vLLM at its defaults; asyncrl: the generator at its defaults
        "ratios": {
            name: {
                "of_bests": result["best"] / sides["plain"]["best"],
                "of_medians": result["median"] / sides["plain"]["median"],
            }
            for name, result in sides.items()
            if name != "plain"
        },
    }
    if "asyncrl" in sides:
        record["ratio_vs_vllm_defaults"] = record["ratios"]["asyncrl"]["of_bests"]
        record["ratio_of_medians"] = record["ratios"]["asyncrl"]["of_medians"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["ratios"]))
    at = stamp(commit=args.commit)
    records.write(args.records, records_of(record, at))
    return 0


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Tokens/s over the rounds of each side but plain vLLM, beside plain vLLM's rounds."""
    sides = report["sides"]
    plain = records.peer("plain vllm.LLM", sides["plain"]["tokens_per_s"])
    settings = {key: report[key] for key in ("batch", "prompt_len", "new_tokens")}
    return [
        records.measure(
            at,
            bench="generator_vs_vllm",
            case=report["model"] + ("" if side == "asyncrl" else f" [{side}]"),
            metric="tokens_per_s",
            unit="tokens/s",
            repeats=result["tokens_per_s"],
            vs=plain,
            settings={**settings, "kv_cache_tokens": result.get("kv_cache_tokens")},
        )
        for side, result in sides.items()
        if side != "plain"
    ]


if __name__ == "__main__":
    sys.exit(main())
