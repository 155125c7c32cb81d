"""The whole pipeline on GPUs: vLLM generators, a ZeRO-3 learner group, NCCL weight push.

Runs ``asyncrl run`` once per staleness bound (0 = synchronous, then 1, 2, 4)
on a random-init Qwen2-shaped model and writes one JSON with, side by side:
samples/s, pipeline efficiency (achieved ÷ min(generator, learner capacity),
the capacities being each side's samples per busy second in the same run),
the speedup over synchronous, the push latency per version (learner side)
and the staleness histogram of consumed samples.

    # 4 GPUs: two generators, a 2-rank learner group
    python bench/scaling_run.py --generator-devices 2,3 --learner-devices 0,1 --out results/scaling_4gpu.json
    # 2 GPUs: one generator, one learner rank
    python bench/scaling_run.py --generator-devices 1 --learner-devices 0 --out results/scaling_2gpu.json

The task is the quickstart's digit copying with its character tokenizer; a
random-init model does not learn it in a few steps, which does not matter
here: the run measures the pipeline, not the policy. Each bound that finished
is appended to ``bench/records/scaling_run.jsonl`` (samples/s beside the
synchronous run's, where that finished too).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import records  # noqa: E402
from bench.push_bench import SHAPES  # noqa: E402


def model_folder(name: str, dtype: str) -> str:
    """Random weights with Qwen2 shapes, saved once, with the quickstart's tokenizer next to them."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    folder = Path(f"/tmp/asyncrl-scaling-{name}")
    if not (folder / "model.safetensors").exists():
        config = Qwen2Config(
            **SHAPES[name], max_position_embeddings=4096, rope_theta=1e6, bos_token_id=1, eos_token_id=2
        )
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.save_pretrained(folder)
        del model
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny-llama" / file, folder / file)
    return str(folder)


def staleness_histogram(run_dir: Path) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for line in (run_dir / "consumed.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "staleness" in record:
            counts[str(record["staleness"])] += 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def push_latencies(run_dir: Path) -> list[float]:
    pattern = re.compile(r"pushed v\d+: .* ([0-9.]+) s$")
    return [
        float(m.group(1))
        for line in (run_dir / "logs/learner.log").read_text().splitlines()
        if (m := pattern.search(line))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--generator-devices", default="1")
    parser.add_argument("--learner-devices", default="0")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups-per-step", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--timeout-s", type=float, default=400)
    parser.add_argument("--out", default="bench/results/scaling.json")
    records.add_argument(parser, "scaling_run")
    args = parser.parse_args()

    import torch

    from asyncrl.launch import local

    cpu = not torch.cuda.is_available()
    dtype = "float32" if cpu else "bfloat16"
    generators = len(args.generator_devices.split(","))
    ranks = len(args.learner_devices.split(","))
    base = Path("/tmp/asyncrl-scaling")
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    config.update(name=f"scaling-{args.model}")
    config["model"] = {"path": model_folder(args.model, dtype), "dtype": dtype}
    config["generator"] = {
        **config.get("generator", {}),
        "backend": "vllm",
        "replicas": generators,
        "devices": None if cpu else args.generator_devices,
        "samples_per_prompt": args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "groups_per_request": 16,
    }
    config["learner"] = {
        **config.get("learner", {}),
        "ranks": ranks,
        "zero_stage": 3,
        "lr": 1e-6,
        "devices": None if cpu else args.learner_devices,
        "total_steps": args.steps,
        "groups_per_step": args.groups_per_step,
        "batch_timeout_s": 300,
        "gradient_checkpointing": True,
        "max_tokens_per_microbatch": 16384,
    }
    config["push"] = {"address": "127.0.0.1:1", "generators": generators, "timeout_s": 120}
    base.mkdir(parents=True, exist_ok=True)
    config_path = base / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))

    gpu = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if not cpu else "CPU only (dry run)"
    results = {
        "machine": f"{gpu}, {os.cpu_count()} CPUs, {platform.node()}",
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "generator_devices": args.generator_devices,
        "learner_devices": args.learner_devices,
        "steps": args.steps,
        "samples_per_step": args.groups_per_step * args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "runs": {},
    }
    for bound in args.staleness:
        run_dir = base / f"staleness-{bound}"
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.monotonic()
        try:
            summary = local.run(
                str(config_path),
                [f"--staleness.max_staleness={bound}"],
                str(run_dir),
                free_ports=True,
                timeout_s=args.timeout_s,
                quiet=True,
            )
        except Exception as error:  # noqa: BLE001  (record it, go on with the next bound)
            results["runs"][str(bound)] = {"error": str(error)[-2000:]}
            print(f"staleness {bound}: {error}", flush=True)
            continue
        pushes = push_latencies(run_dir)
        results["runs"][str(bound)] = {
            **summary,
            "run_wall_s": time.monotonic() - started,
            "push_s_median": statistics.median(pushes) if pushes else None,
            "push_s_max": max(pushes) if pushes else None,
            "pushes": len(pushes),
            "staleness_histogram": staleness_histogram(run_dir),
        }
        print(
            f"staleness {bound}: {summary['achieved_samples_per_s']:.1f} samples/s, "
            f"efficiency {summary['pipeline_efficiency']:.2f}",
            flush=True,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    sync = results["runs"].get("0", {}).get("achieved_samples_per_s")
    for run in results["runs"].values():
        if sync and "achieved_samples_per_s" in run:
            run["speedup_over_sync"] = run["achieved_samples_per_s"] / sync
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    from bench.provenance import stamp

    records.write(args.records, records_of(results, stamp()))


def records_of(results: dict, at: records.Stamp) -> list[records.Record]:
    """Per staleness bound that finished, one run each: samples/s (beside the synchronous run's), pipeline
    efficiency and the learner side's median push."""
    sync = results["runs"].get("0", {}).get("achieved_samples_per_s")
    settings = {key: results[key] for key in ("steps", "samples_per_step", "max_new_tokens")}
    out = []
    for bound, run in results["runs"].items():
        if "achieved_samples_per_s" not in run:
            continue
        common = dict(
            bench="scaling_run",
            case=f"{results['model']}, generators on GPU {results['generator_devices']}, learner on GPU "
            f"{results['learner_devices']}, max_staleness={bound}",
            settings=settings,
        )
        out.append(
            records.measure(
                at,
                **common,
                metric="samples_per_s",
                unit="samples/s",
                repeats=[run["achieved_samples_per_s"]],
                vs=records.peer("sync", [sync]) if sync and bound != "0" else None,
            )
        )
        out.append(
            records.measure(
                at,
                **common,
                metric="pipeline_efficiency",
                unit="of the slower side",
                repeats=[run["pipeline_efficiency"]],
            )
        )
        if run.get("push_s_median") is not None:
            out.append(
                records.measure(
                    at, **common, metric="push_s", unit="s", repeats=[run["push_s_median"]], higher_is_better=False
                )
            )
    return out


if __name__ == "__main__":
    main()
