"""The learner's step alone, on a config's workload: seconds per step, and where a step's time goes.

    python bench/learner_step.py configs/arith-smollm2.yaml --response-tokens 84 32 \\
        --variant learner.liger_kernels=false --out bench/results/learner_step.json --profile DIR

Builds the learner's models as a run does (``learners.process._models``) and times
``learners.step.PolicyStep.run``, the whole of a step's arithmetic (advantages, forward, loss, backward,
optimizer), on batches shaped like the config's: ``learner.groups_per_step`` groups of
``generator.samples_per_prompt`` rollouts to the task's own prompts (through its chat template), every
response ``--response-tokens`` random token ids long (one case per length: an untrained model's answers,
then a trained one's), rewards 0 or 1 at random. Each step is timed between CUDA synchronisations after
``--warmup`` steps; ``gpu_busy`` is the share of the median step the GPU spent in kernels and copies (from
one profiled step), so a step far below 1 waits on the host; ``launches`` and ``host_waits`` count the kernels the
host launched in that step and the times it waited for the GPU. ``--profile DIR`` keeps that step's operators
by GPU time and by host time (text) and its timeline (Chrome trace).

Each ``--variant`` (a set of ``KEY=VALUE`` overrides, comma-separated) runs in a process of its own beside
the config as it is, since some settings (Liger's kernels) patch the model classes for the whole process.
Records go to ``bench/records/learner_step.jsonl``: samples/s per case, each variant beside the config.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402


def workload(config, response_tokens: int, vocab_size: int, seed: int) -> list:
    """One step's rollouts: the task's prompts, random responses of ``response_tokens`` tokens, 0/1 rewards."""
    from transformers import AutoTokenizer

    from asyncrl.tasks import load_items
    from asyncrl.tasks.prompts import prompt_builder
    from asyncrl.wire.protocol import Rollout

    rng = random.Random(seed)
    task = config.prompt_task()
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    build = prompt_builder(task, tokenizer)
    items = load_items(task, tokenizer)[0]
    group_size = config.generator.samples_per_prompt
    batch = []
    for g in range(config.learner.groups_per_step):
        prompt_ids = build(rng.choice(items))
        for i in range(group_size):
            batch.append(
                Rollout(
                    rollout_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    group_size=group_size,
                    prompt_index=g,
                    prompt_ids=prompt_ids,
                    response_ids=[rng.randrange(min(100, vocab_size // 2), vocab_size) for _ in range(response_tokens)],
                    logprobs=[-1.0] * response_tokens,
                    versions=[0] * response_tokens,
                    reward=float(rng.random() < 0.5),
                    finish_reason="length",
                    generator_id="bench",
                    created_s=0.0,
                )
            )
    return batch


def measure_case(step, batch: list, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per step over ``args.steps`` after ``args.warmup``; the GPU's busy share of one more step."""
    import torch

    cuda = torch.cuda.is_available()

    def synced_step() -> float:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        step.run(batch, [])
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(args.warmup):
        synced_step()
    seconds = [synced_step() for _ in range(args.steps)]
    median = statistics.median(seconds)
    result = {
        "step_s": seconds,
        "median_step_s": median,
        "samples_per_s": len(batch) / median,
        "tokens": sum(len(r.prompt_ids) + len(r.response_ids) for r in batch),
    }
    if cuda:
        result.update(profiled_step(synced_step, args))
    return result


LAUNCHES = {"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"}
WAITS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}


def profiled_step(synced_step, args: argparse.Namespace) -> dict[str, Any]:
    """One more step under torch.profiler: the GPU's busy time, and with ``--profile`` its tables and trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = synced_step()
    on_gpu = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy_us, reach = 0.0, float("-inf")  # the union of the GPU's intervals: streams may overlap
    for start, end in on_gpu:
        busy_us += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    host = [e.name for e in prof.events() if e.device_type.name == "CPU"]
    out: dict[str, Any] = {
        "profiled_step_s": wall_s,
        "gpu_busy_s": busy_us / 1e6,
        "gpu_busy": busy_us / 1e6 / wall_s,
        "gpu_ops": len(on_gpu),
        # what a launch-bound step is made of: kernels the host launched, and the times it waited for the GPU
        "launches": sum(1 for name in host if name in LAUNCHES),
        "host_waits": sum(1 for name in host if name in WAITS),
    }
    events = prof.key_averages()
    if args.profile:
        folder = Path(args.profile)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{args.case_name}-{args.length}"
        by_gpu = events.table(sort_by="self_device_time_total", row_limit=35, max_name_column_width=70)
        by_host = events.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=70)
        (folder / f"{name}.txt").write_text(f"# by GPU time\n{by_gpu}\n\n# by host time\n{by_host}\n")
        prof.export_chrome_trace(str(folder / f"{name}.trace.json"))
    return out


def overrides_of(args: argparse.Namespace, variant: list[str] = ()) -> list[str]:
    """The config overrides of every case (``--set``), then a variant's."""
    return [f"--{item}" for item in [*args.set, *variant] if item]


def child(args: argparse.Namespace) -> int:
    """Build the learner under this process's variant and time every response length; each result a line of
    ``--child-out``."""
    import torch

    from asyncrl.config import load_config
    from learners.engine import init_distributed
    from learners.process import _models
    from learners.ranks import Ranks
    from learners.step import PolicyStep

    config = load_config(args.config, overrides_of(args, args.variant_overrides))
    init_distributed()
    torch.manual_seed(0)
    started = time.perf_counter()
    engine, model, reference, critic = _models(config)
    print(f"[{args.case_name}] learner built in {time.perf_counter() - started:.1f} s", flush=True)
    step = PolicyStep(config, engine, Ranks(0, 1, None), reference, critic)
    compile_s = step.compile_now() if config.learner.compile else None
    if compile_s is not None:
        print(f"[{args.case_name}] layers compiled in {compile_s:.1f} s", flush=True)
    settled = {
        "compile_s": compile_s,
        "pack_sequences": config.learner.pack_sequences,
        "attn_implementation": config.learner.attn_implementation,
        "zero_stage": engine.zero_optimization_stage(),
        "dtype": config.model.resolved_dtype(),
    }
    for length in args.response_tokens:
        args.length = length
        batch = steps_of(args, length) or workload(config, length, model.config.vocab_size, seed=length)
        result = {"response_tokens": length, "settled": settled, **measure_case(step, batch, args)}
        print(f"[{args.case_name}] {length}-token answers: {result['median_step_s']:.3f} s a step", flush=True)
        with open(args.child_out, "a") as out:
            out.write(json.dumps(result) + "\n")
    return 0


def steps_of(args: argparse.Namespace, length: int) -> list | None:
    """The step of ``length``-token answers in ``--rollouts-from`` (written by ``--write-rollouts``), if given."""
    if not args.rollouts_from:
        return None
    import msgspec

    from asyncrl.wire.protocol import Rollout

    path = Path(args.rollouts_from) / f"step-{length}.json"
    return msgspec.json.decode(path.read_bytes(), type=list[Rollout])


def write_rollouts(args: argparse.Namespace) -> int:
    """Each response length's step as ``--write-rollouts`` files, for a machine without the task's data loaders."""
    import msgspec
    from transformers import AutoConfig

    from asyncrl.config import load_config

    config = load_config(args.config, overrides_of(args))
    vocab_size = AutoConfig.from_pretrained(config.model.path).vocab_size
    folder = Path(args.write_rollouts)
    folder.mkdir(parents=True, exist_ok=True)
    for length in args.response_tokens:
        batch = workload(config, length, vocab_size, seed=length)
        (folder / f"step-{length}.json").write_bytes(msgspec.json.encode(batch))
    print(f"wrote {len(args.response_tokens)} steps to {folder}")
    return 0


def run_variant(name: str, overrides: list[str], args: argparse.Namespace) -> list[dict] | None:
    """One variant in a process of its own; its results per response length, or None if it failed."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as results:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", name, "--child-out", results.name]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        # The child's output goes straight to ours, its results as it measures them: a run cut short shows
        # what it had.
        code = subprocess.run([*cmd, "--child-overrides", *overrides], timeout=args.timeout_s, cwd=ROOT, env=env)
        lines = results.read().splitlines()
    if code.returncode != 0 or len(lines) != len(args.response_tokens):
        print(
            f"variant {name}: exit {code.returncode}, {len(lines)} of {len(args.response_tokens)} cases",
            file=sys.stderr,
        )
        return None
    return [json.loads(line) for line in lines]


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Samples/s of every case; each variant's beside the config's own at the same response length."""
    out = []
    base = {r["response_tokens"]: r for r in report["variants"]["config"]}

    def rates(result: dict) -> list[float]:
        return [report["samples"] / seconds for seconds in result["step_s"]]

    for name, results in report["variants"].items():
        for result in results:
            length = result["response_tokens"]
            same = base[length]
            out.append(
                records.measure(
                    at,
                    bench="learner_step",
                    case=f"{report['config']}, {length}-token answers"
                    + "".join(f" [{item}]" for item in report["settings"])
                    + ("" if name == "config" else f" [{name}]"),
                    metric="samples_per_s",
                    unit="samples/s",
                    repeats=rates(result),
                    vs=None if name == "config" else records.peer("the config", rates(same)),
                    settings={
                        "samples": report["samples"],
                        "tokens": result["tokens"],
                        "gpu_busy": result.get("gpu_busy"),
                        "launches": result.get("launches"),
                        "host_waits": result.get("host_waits"),
                        **result["settled"],
                    },
                )
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--response-tokens", type=int, nargs="+", default=[84, 32])
    parser.add_argument(
        "--variant", action="append", default=[], help="KEY=VALUE[,KEY=VALUE...]: a case beside the config"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every case"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per variant")
    parser.add_argument("--profile", help="folder: each case's profiled step, as tables and a Chrome trace")
    parser.add_argument("--out", default="bench/results/learner_step.json")
    parser.add_argument("--write-rollouts", help="folder: write each length's step there and stop")
    parser.add_argument("--rollouts-from", help="folder: the steps --write-rollouts wrote, instead of the task's")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    records.add_argument(parser, "learner_step")
    args = parser.parse_args()
    if args.write_rollouts:
        return write_rollouts(args)
    if args.child:
        args.case_name, args.variant_overrides = args.child, args.child_overrides
        try:
            code = child(args)
        except BaseException:  # noqa: BLE001  (the process must end either way: see below)
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        # A normal exit waits on the process group's teardown, which can hang on a GPU machine; the results
        # are written already.
        os._exit(code)

    variants: dict[str, list[dict]] = {}
    for name in ["config", *args.variant]:
        overrides = [] if name == "config" else name.split(",")
        results = run_variant(name, overrides, args)
        if results is None:
            return 1
        for result in results:
            shown = {k: v for k, v in result.items() if k != "step_s"}
            print(name, json.dumps(shown), flush=True)
        variants[name] = results
    from asyncrl.config import load_config

    config = load_config(args.config, overrides_of(args))
    at = stamp()
    report = {
        "what": __doc__.split("\n")[0],
        "config": Path(args.config).stem,
        "samples": config.learner.groups_per_step * config.generator.samples_per_prompt,
        "machine": at.machine,
        "date": at.date,
        "commit": at.commit,
        "settings": args.set,
        "steps": args.steps,
        "warmup": args.warmup,
        "variants": variants,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    records.write(args.records, records_of(report, at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
