"""How long a new version takes from the learner into a running generator on one machine: folder vs shared memory.

The learner side is this process: the model on the learner's device (bf16 on
a GPU, fp32 on CPU) and the real :class:`learners.publisher.Publisher`. The
generator is a child process with a real backend (vLLM by default) and the
receivers it uses in a run. Rounds alternate between the two transports:

* ``folder``: the publisher copies the weights to CPU memory, a thread writes
  the HF folder and announces it, and the generator reloads from the folder;
* ``shared`` (``learner.shared_weights``): the publisher writes the version
  into its shared-memory segment (CUDA IPC on a GPU, a ``/dev/shm`` file on
  CPU) and the generator copies it out into its engine.

Per version it reports how long the learner was held up, how long the
generator took to load, and the whole latency from the start of the publish
to the generator serving the version. Those three, shared memory beside
folders over the rounds' medians, are appended to
``bench/records/handover_bench.jsonl``.

    asyncrl model import smollm2-135m models/smollm2-135m
    python bench/handover_bench.py --out bench/results/handover_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import records  # noqa: E402
from bench.provenance import head_commit, machine, stamp, versions_of  # noqa: E402

TRANSPORTS = ("folder", "shared")
MARK = "handover-bench "  # the generator's answers; vLLM logs to the same stdout


def answer(child) -> dict:
    """The generator's next answer, skipping its log lines."""
    for line in child.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"the generator exited (code {child.wait()}); see its output above")


class Announcements:
    """Stands in for the coordinator: keeps the latest announcement."""

    def __init__(self) -> None:
        self.latest = None

    def publish(self, update) -> None:
        self.latest = update


def overrides(args: argparse.Namespace, work: Path, shared: bool) -> list[str]:
    gpu = args.gpu
    return [
        f"run_dir={work}",
        f"model.path={args.model}",
        f"generator.backend={args.backend}",
        f"learner.shared_weights={str(shared).lower()}",
        "learner.keep_versions=3",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        f"generator.vllm.enforce_eager={str(args.eager).lower()}",
        *([f"generator.vllm.gpu_memory_utilization={args.gpu_memory_utilization}"] if gpu else []),
    ]


# ---------------------------------------------------------------- the generator (a child process)


def generator(args: argparse.Namespace) -> int:
    """Load every announcement read from stdin (hex msgpack, one per line); answer with a JSON line each."""
    from asyncrl.config import load_config
    from asyncrl.weights.transports import FolderReceiver, SharedReceiver
    from asyncrl.wire import protocol
    from generators import open_backend

    config = load_config(None, overrides(args, Path(args.work), shared=False))
    backend = open_backend(config)
    receivers = {"folder": FolderReceiver(), "shared": SharedReceiver()}
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        update = protocol.decode(bytes.fromhex(line.strip()), protocol.WeightUpdate)
        started = time.monotonic()
        receivers[update.transport].receive(update, backend, timeout_s=120)
        load_s = time.monotonic() - started
        if backend.version != update.version:
            raise RuntimeError(f"still on v{backend.version} after loading v{update.version}")
        print(MARK + json.dumps({"version": update.version, "load_s": load_s}), flush=True)
    backend.close()
    return 0


# ---------------------------------------------------------------- the learner (this process)


def measure(args: argparse.Namespace, model, child, transport: str, first_version: int, work: Path) -> dict:
    import torch

    from asyncrl.config import load_config
    from asyncrl.wire import protocol
    from learners.publisher import Publisher

    config = load_config(None, overrides(args, work, shared=transport == "shared"))
    coordinator = Announcements()
    publisher = Publisher(config, model, coordinator, work / "weights")
    assert publisher.transport == transport, publisher.transport
    held, ready, load, latency = [], [], [], []
    first = next(model.parameters())
    for version in range(first_version, first_version + args.versions):
        with torch.no_grad():
            first.add_(1e-3)  # a new version differs from the last
        started = time.monotonic()
        held.append(publisher.publish(version))
        publisher.finish()  # the folder is written and announced (a no-op for shared weights)
        ready.append(time.monotonic() - started)
        assert coordinator.latest is not None and coordinator.latest.version == version
        child.stdin.write(protocol.encode(coordinator.latest).hex() + "\n")
        child.stdin.flush()
        loaded = answer(child)
        assert loaded["version"] == version, loaded
        load.append(loaded["load_s"])
        latency.append(time.monotonic() - started)

    def ms(values: list[float]) -> dict:
        tail = values[1:] or values  # the first version also opens the segment or warms the reload path
        return {"median": round(1000 * statistics.median(tail), 2), "max": round(1000 * max(tail), 2)}

    return {
        "transport": transport,
        "versions": args.versions,
        "learner_held_ms": ms(held),
        "ready_ms": ms(ready),
        "generator_load_ms": ms(load),
        "latency_ms": ms(latency),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/smollm2-135m"), help="HF folder")
    parser.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--versions", type=int, default=10, help="per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each transport, alternating")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (a faster start)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--work", type=Path, default=None, help="where folder versions go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--role", choices=("learner", "generator"), default="learner", help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    records.add_argument(parser, "handover_bench")
    args = parser.parse_args(argv)
    if args.role == "generator":
        return generator(args)
    if args.out is None:
        parser.error("--out is required")

    import torch
    from transformers import AutoModelForCausalLM

    args.gpu = torch.cuda.is_available()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="asyncrl-handover-"))
    device = "cuda" if args.gpu else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.gpu else torch.float32)
    model.to(device)
    child_args = [
        sys.executable,
        __file__,
        "--role",
        "generator",
        "--model",
        args.model,
        "--backend",
        args.backend,
        "--work",
        str(args.work),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        *(["--eager"] if args.eager else []),
        *(["--gpu"] if args.gpu else []),
    ]
    started = time.monotonic()
    child = subprocess.Popen(child_args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        answer(child)  # ready
        engine_start_s = time.monotonic() - started
        print(f"generator ({args.backend}) ready in {engine_start_s:.1f} s", flush=True)
        runs, version = [], 1
        for round_ in range(args.rounds):  # alternating, so a slow spell of the machine hits both
            for transport in TRANSPORTS:
                row = measure(args, model, child, transport, version, args.work / f"{transport}-{round_}")
                version += args.versions
                runs.append({"round": round_, **row})
                print(
                    f"round {round_}, {transport}: learner held {row['learner_held_ms']['median']} ms, "
                    f"generator load {row['generator_load_ms']['median']} ms, publish to serving "
                    f"{row['latency_ms']['median']} ms (medians)",
                    flush=True,
                )
    finally:
        child.stdin.close()
        child.wait(timeout=120)

    def median_of(transport: str, key: str) -> float:
        return statistics.median(r[key]["median"] for r in runs if r["transport"] == transport)

    keys = ("learner_held_ms", "generator_load_ms", "latency_ms")
    medians = {t: {k: median_of(t, k) for k in keys} for t in TRANSPORTS}
    commit = head_commit()
    params = sum(p.numel() for p in model.parameters())
    report = {
        "benchmark": "a new version from the learner into a running generator on one machine: HF folder against "
        "shared memory (CUDA IPC on a GPU, a /dev/shm file on CPU)",
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.gpu),
        "versions_of": versions_of(),
        "commit": commit,
        "command": " ".join(["python", "bench/handover_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model,
        "parameters": params,
        "dtype": "bfloat16" if args.gpu else "float32",
        "backend": args.backend,
        "engine_start_s": engine_start_s,
        "versions_per_round": args.versions,
        "rounds": args.rounds,
        "runs": runs,
        "medians": medians,
        "latency_ratio_folder_over_shared": medians["folder"]["latency_ms"] / medians["shared"]["latency_ms"],
        "held_ratio_folder_over_shared": medians["folder"]["learner_held_ms"] / medians["shared"]["learner_held_ms"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"publish to serving: folder {medians['folder']['latency_ms']} ms, shared {medians['shared']['latency_ms']} "
        f"ms ({report['latency_ratio_folder_over_shared']:.1f}x); wrote {args.out}",
        flush=True,
    )
    records.write(args.records, records_of(report, stamp(args.gpu)))
    return 0


def records_of(report: dict, at: records.Stamp) -> list[records.Record]:
    """Shared memory beside folders, over the rounds' per-version medians: learner held, generator load, latency."""

    def rounds(transport: str, key: str) -> list[float]:
        return [r[key]["median"] for r in report["runs"] if r["transport"] == transport]

    settings = {key: report[key] for key in ("dtype", "backend", "versions_per_round", "rounds")}
    return [
        records.measure(
            at,
            bench="handover_bench",
            case=f"{Path(report['model']).name}, {report['dtype']}, {report['backend']}",
            metric=key,
            unit="ms",
            repeats=rounds("shared", key),
            higher_is_better=False,
            vs=records.peer("folder", rounds("folder", key), higher_is_better=False),
            settings=settings,
        )
        for key in ("learner_held_ms", "generator_load_ms", "latency_ms")
    ]


if __name__ == "__main__":
    sys.exit(main())
