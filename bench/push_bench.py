"""The generator side on two GPUs: wrapper overhead and weight push latency, in one run.

GPU 1 runs asyncrl's vLLM backend (the engine in this process). GPU 0 runs a
DeepSpeed ZeRO-3 learner rank (a child process) with the same random-init
Qwen2-shaped model. For each model size the run measures:

* **wrapper**: tokens/s of asyncrl's backend against plain ``vllm.LLM.generate``
  on the same engine and prompts, alternating, best of ``--rounds``;
* **push**: end to end, from the learner starting to gather its ZeRO-3 shards
  to the engine serving the new version (gather, bucketed NCCL broadcast,
  validation, vLLM's in-place reload);
* **floor**: a raw NCCL broadcast of the same number of bytes over the same group.

    python bench/push_bench.py --models 0.5b 1.5b --out results/push_bench.json

Needs two GPUs, vLLM and DeepSpeed. Results are written after every phase,
so a run cut short still leaves what it measured. At the end, each real model's
push (beside the floor) and wrapper tokens/s (beside plain vLLM) are appended
to ``bench/records/push_bench.jsonl``; the CPU dry run's ``tiny`` is not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.wire.ports import free_port  # noqa: E402
from bench import records  # noqa: E402
from bench.learner_bench import SHAPES as QWEN2_SHAPES  # noqa: E402

SHAPES = {
    **QWEN2_SHAPES,
    # a dry run of the script on CPU (vLLM's CPU build, gloo)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
CUDA = os.environ.get("ASYNCRL_BENCH_CPU") != "1"


def sync() -> None:
    if CUDA:
        import torch

        torch.cuda.synchronize()


def model_folder(name: str) -> str:
    from transformers import Qwen2Config

    folder = f"/tmp/asyncrl-push-{name}"
    Qwen2Config(
        **SHAPES[name], max_position_embeddings=4096, rope_theta=1e6, eos_token_id=151643, bos_token_id=151643
    ).save_pretrained(folder)
    return folder


# --- the learner rank (child process, GPU 0) -------------------------------------------------------


def learner(folder: str, address: str, bucket_mb: int) -> None:
    """Reads commands as JSON lines on stdin; answers each with one JSON line on stdout."""
    import torch

    from asyncrl.config import LearnerConfig, ModelConfig
    from asyncrl.weights.push import WeightGroup, spec_of
    from learners.engine import build_engine, gathered_parameters, init_distributed

    init_distributed()
    engine, model = build_engine(
        LearnerConfig(zero_stage=3, lr=1e-5),
        ModelConfig(path=folder, dtype="bfloat16" if CUDA else "float32", random_init=True),
    )
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    secret = (Path(folder) / "push.secret").read_text().strip()
    group = WeightGroup(address, 0, 2, "nccl" if CUDA else "gloo", 120.0, device, secret)
    specs = [spec_of(name, p) for name, p in model.named_parameters()]
    bucket_bytes = bucket_mb * 2**20
    reply({"ready": True, "bytes": sum(s.num_bytes for s in specs), "tensors": len(specs)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "push":
            sync()
            started = time.perf_counter()
            stats = group.send(
                cmd["epoch"], cmd["version"], specs, gathered_parameters(model, bucket_bytes, device), bucket_bytes
            )
            sync()
            reply({"send_s": time.perf_counter() - started, "buckets": stats.num_buckets})
        elif cmd["cmd"] == "gather":  # the gather alone, no network
            sync()
            started = time.perf_counter()
            for _ in gathered_parameters(model, bucket_bytes, device):
                pass
            sync()
            reply({"gather_s": time.perf_counter() - started})
        elif cmd["cmd"] == "checksum":  # the same statistics the engine computes on its copy
            reply({"checksum": checksum(dict(gathered_parameters(model, bucket_bytes, device)))})
        elif cmd["cmd"] == "probe":
            reply({"probe_s": group.probe(cmd["epoch"], cmd["bytes"])})
        else:
            break
    group.close()


CHECKED = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight")


def checksum(params: dict) -> list[float]:
    return [float(params[name].double().sum()) + float(params[name].double().abs().sum()) for name in CHECKED]


def engine_checksum(worker) -> list[float]:
    """Runs on the vLLM worker: the checked tensors as the engine holds them.

    Meaningful on GPU only: the CPU build repacks linear weights after loading
    and leaves the original parameters empty, so a CPU dry run reports a mismatch.
    """
    return checksum(dict(worker.model_runner.get_model().named_parameters()))


def reply(obj: dict) -> None:
    print("@@" + json.dumps(obj), flush=True)


class Learner:
    def __init__(self, folder: str, address: str, bucket_mb: int) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0") if CUDA else dict(os.environ)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "learner",
                "--folder",
                folder,
                "--address",
                address,
                "--bucket-mb",
                str(bucket_mb),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
            sys.stdout.write("[learner] " + line)
        raise RuntimeError(f"learner exited with {self.proc.wait()}")

    def close(self) -> None:
        self.send(cmd="quit")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- the generator (this process, GPU 1) -----------------------------------------------------------


def wrapper_overhead(backend, batch: int, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    """asyncrl's backend vs plain ``LLM.generate``: same engine, prompts and sampling."""
    import random

    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    from generators.base import GenerationRequest, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(batch)]
    plain_params = VllmSamplingParams(
        n=1, max_tokens=new_tokens, temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True, logprobs=0
    )
    backend.ignore_eos = True

    def plain() -> int:
        outs = backend.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], plain_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def ours() -> int:
        reqs = [GenerationRequest(f"p{i}", p) for i, p in enumerate(prompts)]
        params = SamplingParams(n=1, max_new_tokens=new_tokens, temperature=1.0)
        return sum(len(s.token_ids) for _, samples in backend.generate(reqs, params) for s in samples)

    plain(), ours()  # warm-up
    runs: dict[str, list[float]] = {"plain": [], "asyncrl": []}
    for _ in range(rounds):
        for name, fn in (("plain", plain), ("asyncrl", ours)):
            started = time.perf_counter()
            tokens = fn()
            runs[name].append(tokens / (time.perf_counter() - started))
    best = {k: max(v) for k, v in runs.items()}
    median = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tokens_per_s": runs,
        "best_plain": best["plain"],
        "best_asyncrl": best["asyncrl"],
        "ratio": best["asyncrl"] / best["plain"],
        "ratio_of_medians": median["asyncrl"] / median["plain"],
    }


def push_latency(backend, learner: Learner, num_bytes: int, reps: int) -> dict:
    epoch = 1
    results = []
    for version in range(1, reps + 2):
        started = time.perf_counter()
        learner.send(cmd="push", epoch=epoch, version=version)
        backend.receive_push(epoch, version, timeout_s=120)
        sync()
        e2e = time.perf_counter() - started
        results.append({"version": version, "e2e_s": e2e, **learner.answer()})
        assert backend.version == version
    learner.send(cmd="checksum")
    expected = learner.answer()["checksum"]
    got = backend.llm.collective_rpc(engine_checksum)[0]
    weights_match = all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(expected, got))
    warm = results[1:]  # the first push also forms the NCCL group
    learner.send(cmd="gather")
    gather = learner.answer()["gather_s"]
    floors = []
    for _ in range(reps):
        learner.send(cmd="probe", epoch=epoch, bytes=num_bytes)
        backend.llm.collective_rpc("push_probe", args=(epoch, num_bytes))
        floors.append(learner.answer()["probe_s"])
    floor = min(floors)
    e2e = sorted(r["e2e_s"] for r in warm)[len(warm) // 2]
    return {
        "bytes": num_bytes,
        "weights_match": weights_match,
        "checksums": [expected, got],
        "first_push_s": results[0]["e2e_s"],
        "pushes": warm,
        "median_e2e_s": e2e,
        "gather_only_s": gather,
        "floor_s": floor,
        "floors_s": floors,
        "floor_gb_per_s": num_bytes / floor / 1e9,
        "target_s": 2 * floor + 0.020,
        "ratio_to_floor": e2e / floor,
        "meets_target": e2e <= 2 * floor + 0.020,
    }


def generate_after_push(backend) -> bool:
    """The engine still samples after the pushes (and the tokens carry the last version)."""
    from generators.base import GenerationRequest, SamplingParams

    out = list(
        backend.generate([GenerationRequest("check", [1000, 2000, 3000])], SamplingParams(n=2, max_new_tokens=8))
    )
    return all(s.versions == [backend.version] * len(s.token_ids) for _, samples in out for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="main", choices=["main", "learner"])
    parser.add_argument("--folder"), parser.add_argument("--address")
    parser.add_argument("--models", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip phases that would not finish by then")
    parser.add_argument("--out", default="bench/results/push_bench.json")
    records.add_argument(parser, "push_bench")
    args = parser.parse_args()
    if args.role == "learner":
        return learner(args.folder, args.address, args.bucket_mb)

    if CUDA:
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    began = time.monotonic()
    import torch
    import vllm

    from asyncrl.config import PushConfig
    from generators.vllm_backend import VllmBackend

    gpu = f"{torch.cuda.get_device_name(0)} x2" if CUDA else "CPU only (dry run)"
    results = {
        "machine": f"{gpu}, {os.cpu_count()} CPUs, {platform.node()}",
        "date": time.strftime("%Y-%m-%d"),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "bucket_mb": args.bucket_mb,
        "models": {},
    }

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))

    for name in args.models:
        if time.monotonic() - began > args.deadline_s - 150:
            results["models"][name] = {"skipped": "not enough time left in this run"}
            save()
            continue
        folder = model_folder(name)
        address = f"127.0.0.1:{free_port()}"
        secret_file = Path(folder) / "push.secret"  # the push store listens on every interface: keyed
        secret_file.write_text(secrets.token_urlsafe(32) + "\n")
        secret_file.chmod(0o600)
        learner_proc = Learner(folder, address, args.bucket_mb)
        t0 = time.monotonic()
        backend = VllmBackend(
            folder,
            dtype="bfloat16" if CUDA else "float32",
            enforce_eager=True,
            load_format="dummy",
            kv_cache_memory_bytes=(8 if CUDA else 1) * 2**30,
            max_model_len=1024,
            max_num_seqs=args.batch,
            push=PushConfig(address=address, generators=1, timeout_s=120.0, secret_file=str(secret_file)),
            push_rank=1,
        )
        entry: dict = {"engine_start_s": time.monotonic() - t0}
        ready = learner_proc.answer()
        entry["learner"] = ready
        print(
            f"[{name}] engine up in {entry['engine_start_s']:.0f}s; learner holds {ready['bytes'] / 1e9:.2f} GB",
            flush=True,
        )
        results["models"][name] = entry
        try:
            entry["push"] = push_latency(backend, learner_proc, ready["bytes"], args.reps)
            print(f"[{name}] push {json.dumps({k: v for k, v in entry['push'].items() if k != 'pushes'})}", flush=True)
            entry["samples_after_push_ok"] = generate_after_push(backend)
            save()
            entry["wrapper"] = wrapper_overhead(backend, args.batch, 256, 256, args.rounds)
            print(f"[{name}] wrapper {json.dumps(entry['wrapper'])}", flush=True)
            save()
        finally:
            learner_proc.close()
            backend.close()
            if CUDA:
                torch.cuda.empty_cache()
    save()
    from bench.provenance import stamp

    records.write(args.records, records_of(results, stamp(gpu=CUDA, gpus=2)))


def records_of(results: dict, at: records.Stamp) -> list[records.Record]:
    """Per real model measured: the push's milliseconds over its pushes beside the NCCL floor's, and the wrapper's
    tokens/s over its rounds beside plain ``LLM.generate`` on the same engine (the CPU dry run's tiny: none)."""
    out = []
    for name, entry in results["models"].items():
        if name == "tiny":
            continue
        settings = {"bucket_mb": results["bucket_mb"], "bytes": entry.get("learner", {}).get("bytes")}
        if "push" in entry:
            push = entry["push"]
            out.append(
                records.measure(
                    at,
                    bench="push_bench",
                    case=name,
                    metric="push_ms",
                    unit="ms",
                    repeats=[p["e2e_s"] * 1000 for p in push["pushes"]],
                    higher_is_better=False,
                    vs=records.peer(
                        "NCCL floor",
                        [f * 1000 for f in push.get("floors_s", [push["floor_s"]])],
                        higher_is_better=False,
                    ),
                    settings=settings,
                )
            )
        if "wrapper" in entry:
            rates = entry["wrapper"]["tokens_per_s"]
            out.append(
                records.measure(
                    at,
                    bench="push_bench",
                    case=name,
                    metric="wrapper_tokens_per_s",
                    unit="tokens/s",
                    repeats=rates["asyncrl"],
                    vs=records.peer("plain LLM.generate", rates["plain"]),
                    settings={**settings, "batch": entry["wrapper"]["batch"]},
                )
            )
    return out


if __name__ == "__main__":
    main()
