"""End to end on GPUs: does the pipeline keep both sides busy, and how close is async to its bound?

For each workload, ``asyncrl run --compare-sync`` trains the same config
twice, asynchronously (the config's ``max_staleness``, 1; until 2026-12-06,
2) and synchronously (0), with the
generator (vLLM at its GPU defaults) and the learner (DeepSpeed) on the same
GPUs as a user's one-machine run. From the two summaries:

* ``pipeline_efficiency``: async samples/s over min(generator capacity,
  learner capacity), both capacities measured in the same async run;
* ``async_over_sync``: sync wall-clock over async wall-clock for the same
  steps;
* ``async_over_sync_bound``: ``(Tg + Tt) / max(Tg, Tt)``, the most overlap
  can give, with ``Tg`` and ``Tt`` a step's generation and training time
  taken from the sync run, where each side works alone;
* ``async_over_sync_tokens``: the same ratio in response tokens trained per second.
  SmolLM2 learns to answer briefly, and the two runs learn at their own
  pace: once their responses differ in length, equal steps are unequal work
  and only this ratio compares the pipelines (the 0.5B shape's responses
  all run to the limit, so there the two ratios agree).

Workloads: SmolLM2-135M-Instruct on ``data/arith-story1`` (``asyncrl model
import smollm2-135m models/smollm2-135m`` first), and a random-init model of
Qwen2-0.5B's shape with SmolLM2's tokenizer, whose responses run to
``--max-new-tokens``. Prompts are the story problems (about 100 tokens with
the chat template).

    python bench/e2e.py --gpus 1 --out bench/results/gpu_e2e_1gpu.json

Writes the JSON (machine, date, commit, every summary, the figures above per
workload) and appends the figures to ``bench/records/e2e.jsonl``: one case per
workload, named with any ``--set`` overrides so that they never stand for the
defaults.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from learning_run import machine  # noqa: E402

from bench import records  # noqa: E402
from bench.provenance import head_commit, stamp  # noqa: E402

SMOLLM2 = ROOT / "models/smollm2-135m"
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def random_qwen_folder(work: Path) -> Path:
    """Qwen2-0.5B's shape, random weights in bf16, SmolLM2's tokenizer (no hub on the machine)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    folder = work / "qwen2-0.5b-shape"
    if (folder / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    config = Qwen2Config(
        **QWEN2_05B,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def overrides(workload: str, args: argparse.Namespace, work: Path) -> list[str]:
    """The arithmetic GPU config, at the product's GPU defaults (bf16, CUDA graphs, prefix caching)."""
    # Device lists are strings: quoted, so that YAML does not read "0" as a number.
    if args.gpus == 1:  # generator and learner share the GPU, vLLM taking --vllm-memory of it
        roles = [
            "--learner.devices='0'",
            "--generator.devices='0'",
            f"--generator.vllm.gpu_memory_utilization={args.vllm_memory}",
        ]
    else:  # one role per GPU: the learner on the first, one generator on each of the others
        roles = [
            "--learner.devices='0'",
            f"--generator.devices='{','.join(str(i) for i in range(1, args.gpus))}'",
            f"--generator.replicas={args.gpus - 1}",
            "--generator.vllm.gpu_memory_utilization=null",
        ]
    common = [
        f"--learner.total_steps={args.steps}",
        "--learner.max_train_s=0",
        "--eval.every_steps=0",
        "--model.dtype=auto",
        "--generator.vllm.enforce_eager=null",
        "--generator.vllm.enable_prefix_caching=null",
        "--generator.vllm.kv_cache_memory_bytes=null",
        f"--generator.max_new_tokens={args.max_new_tokens}",
        "--learner.max_tokens_per_microbatch=32768",
        *roles,
    ]
    settings = [f"--{setting}" for setting in args.set]  # last: an override wins over the workload's own
    if workload == "smollm2-135m":
        return common + [f"--model.path={SMOLLM2}"] + settings
    return (
        common
        + [
            f"--model.path={random_qwen_folder(work)}",
            f"--learner.groups_per_step={args.groups_0p5b}",
            f"--generator.groups_per_request={args.groups_0p5b}",
            "--learner.lr=1e-6",
        ]
        + settings
    )


def tokens_per_s(run_dir: Path) -> float:
    """Response tokens trained on per second of the run's training wall-clock (``summary.json``)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sum(r["tokens"] for r in records) / json.loads((run_dir / "summary.json").read_text())["wall_s"]


def measure(workload: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / workload
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "run",
        str(ROOT / "configs/arith-smollm2.yaml"),
        "--run-dir",
        str(run_dir),
        "--compare-sync",
        "--free-ports",
        "--timeout-s",
        str(args.timeout_s),
        *overrides(workload, args, work),
    ]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    result = json.loads((run_dir / "compare.json").read_text())
    a, s = result["async"], result["sync"]
    samples_per_step = a["samples_consumed"] / a["steps"]
    tg = samples_per_step / s["generator_capacity_samples_per_s"]
    tt = samples_per_step / s["learner_capacity_samples_per_s"]
    return {
        "pipeline_efficiency": a["pipeline_efficiency"],
        "async_over_sync": s["wall_s"] / a["wall_s"],
        "async_over_sync_tokens": tokens_per_s(run_dir / "async") / tokens_per_s(run_dir / "sync"),
        "async_over_sync_bound": (tg + tt) / max(tg, tt),
        "step_generation_s_sync": tg,
        "step_training_s_sync": tt,
        "async_samples_per_s": a["achieved_samples_per_s"],
        "sync_samples_per_s": s["achieved_samples_per_s"],
        "async": a,
        "sync": s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1, help="1: generator and learner share the GPU")
    parser.add_argument("--workloads", nargs="+", default=["smollm2-135m", "qwen2-0.5b-shape"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--groups-0p5b", type=int, default=8, help="groups per step for the 0.5B shape")
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of the GPU it shares")
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncrl-e2e"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--timeout-s", type=float, default=3000.0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run, e.g. learner.pack_sequences=true (repeatable)",
    )
    records.add_argument(parser, "e2e")
    args = parser.parse_args(argv)
    for setting in args.set:
        if "=" not in setting:
            parser.error(f"--set {setting}: expected KEY=VALUE, e.g. learner.pack_sequences=true")
    args.work.mkdir(parents=True, exist_ok=True)
    commit = args.commit or head_commit() or "unknown"
    results = {}
    for workload in args.workloads:
        results[workload] = measure(workload, args, args.work)
        print(workload, {k: round(v, 3) for k, v in results[workload].items() if isinstance(v, float)}, flush=True)
    report = {
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "gpus": args.gpus,
        "steps": args.steps,
        "max_new_tokens": args.max_new_tokens,
        "settings": args.set,
        "workloads": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    at = stamp(commit=args.commit)
    records.write(args.records, records_of(report, at))
    return 0


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Per workload: pipeline efficiency, async samples/s beside sync, the overlap bound and how much of it async
    reached, the tokens ratio, and each side's capacity alone (from the sync run). One run each: n = 1."""
    out = []
    for workload, r in report["workloads"].items():
        case = workload + (f" [{', '.join(report['settings'])}]" if report.get("settings") else "")
        steps = report["steps"][workload] if isinstance(report["steps"], dict) else report["steps"]
        settings = {"gpus": report["gpus"], "steps": steps, "max_new_tokens": report["max_new_tokens"]}
        settings.update(set=report.get("settings", []), max_staleness=r["async"]["max_staleness"])

        figures = [
            ("pipeline_efficiency", r["pipeline_efficiency"], "of the slower side", None),
            ("samples_per_s", r["async_samples_per_s"], "samples/s", records.peer("sync", [r["sync_samples_per_s"]])),
            ("async_over_sync_bound", r["async_over_sync_bound"], "x", None),
            ("async_over_bound", r["async_over_sync"] / r["async_over_sync_bound"], "x", None),
            ("async_over_sync_tokens", r.get("async_over_sync_tokens"), "x", None),  # absent from the earliest results
            ("generator_alone_samples_per_s", r["sync"]["generator_capacity_samples_per_s"], "samples/s", None),
            ("learner_alone_samples_per_s", r["sync"]["learner_capacity_samples_per_s"], "samples/s", None),
        ]
        out += [
            records.measure(
                at, bench="e2e", case=case, metric=metric, unit=unit, repeats=[value], vs=vs, settings=settings
            )
            for metric, value, unit, vs in figures
            if value is not None
        ]
    return out


if __name__ == "__main__":
    sys.exit(main())
