"""Served weights: bytes and time per version, whole model against the lossless delta, at Qwen2-0.5B's shape.

A generator outside the learner's network fetches every published version
from the weight server (``coordinator.weights_address``). With
``coordinator.weight_deltas`` it fetches only the bitwise difference from
the version it holds, compressed (:mod:`asyncrl.weights.delta`).

The model is random at Qwen2-0.5B's shape (494M parameters, bf16 as
published from a bf16 learner), with fp32 master weights. Each version
moves every master weight by ``lr`` with a random sign, the size of an
Adam step (``m / sqrt(v)`` is about 1 per element in early steps; later ones
are smaller, which only makes deltas smaller), and publishes the bf16
rounding. Per learning rate, three versions are fetched over loopback
ZeroMQ: whole, and as a delta from the previous one by two generators (the
server computes each delta once: the first generator's fetch pays for it,
the second's does not). A delta fetch includes applying and checking it.

    python bench/delta_bench.py --out bench/results/delta_bench.json

Also appends each learning rate's delta size and fetch times (delta beside
whole) to ``bench/records/delta_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def master_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B))
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding: published once
        scale = 1.0 if "norm" in name else 0.02
        out[name] = torch.randn(param.shape, generator=generator) * scale + (1.0 if "norm" in name else 0.0)
    return out


def publish(master: dict[str, torch.Tensor], version: int, weights_dir: Path) -> None:
    from asyncrl.weights import folders

    bf16 = ((name, t.to(torch.bfloat16)) for name, t in master.items())
    config = json.dumps({"model_type": "qwen2", **QWEN2_05B})
    folders.publish(
        bf16,
        version=version,
        weights_dir=weights_dir,
        model_dir=weights_dir.parent,
        config_json=config,
        keep_versions=4,
    )


def timed_fetch(version: int, address: str, cache: Path, base: int | None) -> float:
    from asyncrl.weights.served import fetch

    started = time.perf_counter()
    fetch(version, address, cache, timeout_s=600, base=base)
    return time.perf_counter() - started


def run_lr(lr: float, work: Path, port: int) -> dict:
    from asyncrl.weights import delta as weight_delta
    from asyncrl.weights.folders import version_dir
    from asyncrl.weights.served import WeightServer

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    weights_dir, address = work / "learner", f"tcp://127.0.0.1:{port}"
    master = master_weights()
    publish(master, 0, weights_dir)
    whole_bytes = (version_dir(weights_dir, 0) / "model.safetensors").stat().st_size
    server = WeightServer(weights_dir, address, deltas=True)
    rows = []
    try:
        for cache in ("first", "second"):  # two generators, both holding v0
            timed_fetch(0, address, work / cache, None)
        generator = torch.Generator().manual_seed(1)
        for version in (1, 2, 3):
            for tensor in master.values():
                tensor.add_(torch.randint(0, 2, tensor.shape, generator=generator).float().mul_(2 * lr).sub_(lr))
            publish(master, version, weights_dir)
            old = version_dir(weights_dir, version - 1) / "model.safetensors"
            new = version_dir(weights_dir, version) / "model.safetensors"
            started = time.perf_counter()
            delta = weight_delta.encode(old, new, version - 1, version)
            encode_s = time.perf_counter() - started
            changed = _changed_fraction(old, new)
            first_s = timed_fetch(version, address, work / "first", version - 1)  # the server encodes the delta
            second_s = timed_fetch(version, address, work / "second", version - 1)  # and reuses it
            whole_s = timed_fetch(version, address, work / f"whole-{version}", None)
            shutil.rmtree(work / f"whole-{version}")
            rows.append(
                {
                    "version": version,
                    "whole_bytes": whole_bytes,
                    "delta_bytes": len(delta),
                    "delta_fraction": len(delta) / whole_bytes,
                    "bf16_values_changed": changed,
                    "encode_s": encode_s,
                    "fetch_whole_s": whole_s,
                    "fetch_delta_first_s": first_s,
                    "fetch_delta_s": second_s,
                }
            )
            print(
                json.dumps({"lr": lr, **{k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}}),
                flush=True,
            )
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"lr": lr, "versions": rows}


def _changed_fraction(old: Path, new: Path) -> float:
    from safetensors import safe_open

    changed = total = 0
    with safe_open(str(old), "pt") as a, safe_open(str(new), "pt") as b:
        for name in a.keys():
            x, y = a.get_tensor(name).view(torch.int16), b.get_tensor(name).view(torch.int16)
            changed += int((x != y).sum())
            total += x.numel()
    return changed / total


def main(argv: list[str] | None = None) -> int:
    from learning_run import machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "asyncrl-delta-bench")
    parser.add_argument("--port", type=int, default=5597)
    parser.add_argument("--out", type=Path, required=True)
    records.add_argument(parser, "delta_bench")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    results = [run_lr(lr, args.work, args.port) for lr in args.lrs]
    report = {
        "what": __doc__.splitlines()[0],
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "model": "Qwen2-0.5B shape, random, bf16 as published",
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2))
    records.write(args.records, records_of(report, stamp(gpu=False)))
    return 0


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Per learning rate, over its versions: the delta's share of the whole, the server's encode time, and the
    fetch time of a delta (reused by the server) beside that of the whole version."""
    out = []
    for result in report["results"]:
        rows = result["versions"]
        settings = {"model": report["model"], "lr": result["lr"], "whole_bytes": rows[0]["whole_bytes"]}
        common = dict(bench="delta_bench", case=f"lr={result['lr']:g}", higher_is_better=False, settings=settings)
        out += [
            records.measure(
                at, **common, metric="delta_fraction", unit="of whole", repeats=[r["delta_fraction"] for r in rows]
            ),
            records.measure(at, **common, metric="encode_s", unit="s", repeats=[r["encode_s"] for r in rows]),
            records.measure(
                at,
                **common,
                metric="fetch_delta_s",
                unit="s",
                repeats=[r["fetch_delta_s"] for r in rows],
                vs=records.peer("whole", [r["fetch_whole_s"] for r in rows], higher_is_better=False),
            ),
        ]
    return out


if __name__ == "__main__":
    sys.exit(main())
