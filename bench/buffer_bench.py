"""ZMQ vs Redis rollout buffer throughput, in one run on one machine.

One writer process (spawned) puts realistic rollouts (256 prompt + 512
response tokens, a logprob and a version per response token) in batches of
100; the reader, in this process, loops ``get(max_items=256)`` + ``ack``
until it has them all. Both sides encode/decode with msgspec exactly as in a
run. Throughput is counted from the moment the writer is released to the
moment the reader holds the last rollout; runs of the backends are
interleaved and best and median of ``--repeats`` are reported.

Backends: ZMQ PUSH/PULL on loopback TCP; Redis (redis-server on a free
loopback port, started like the test fixture) without persistence, and with
AOF ``appendfsync everysec``, the setting a durable run would use.

    python bench/buffer_bench.py [--rollouts 20000] [--repeats 3]

Writes ``bench/results/buffer_bench.json`` and appends the rollouts/s of each
backend (Redis beside ZeroMQ) to ``bench/records/buffer_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's packages, and the test Redis helper

import msgspec  # noqa: E402

from asyncrl.config import BufferConfig  # noqa: E402
from asyncrl.wire.protocol import Rollout, RolloutLimits, encode  # noqa: E402
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

PROMPT_TOKENS, RESPONSE_TOKENS = 256, 512
WRITE_BATCH, READ_BATCH = 100, 256
CAPACITY = 1024


def template_rollout(seed: int = 0) -> Rollout:
    """One realistic rollout: random ids of a 32k vocabulary, float64 logprobs, two versions."""
    rng = random.Random(seed)
    return Rollout(
        rollout_id="template",
        group_id="g",
        group_size=8,
        prompt_index=0,
        prompt_ids=[rng.randrange(32000) for _ in range(PROMPT_TOKENS)],
        response_ids=[rng.randrange(32000) for _ in range(RESPONSE_TOKENS)],
        logprobs=[-rng.expovariate(1.0) for _ in range(RESPONSE_TOKENS)],
        versions=[41] * (RESPONSE_TOKENS // 2) + [42] * (RESPONSE_TOKENS - RESPONSE_TOKENS // 2),
        reward=1.0,
        finish_reason="stop",
        generator_id="gen-0",
        created_s=time.time(),
        generate_s=1.5,
    )


def make_writer(kind: str, target: Any) -> Any:
    if kind == "zmq":
        from buffers.zmq_buffer import ZmqWriter

        return ZmqWriter(target, CAPACITY)
    from buffers.redis_writer import RedisWriter

    return RedisWriter(target)


def make_reader(kind: str, target: Any) -> Any:
    if kind == "zmq":
        from buffers.zmq_buffer import ZmqReader

        return ZmqReader(target, CAPACITY, RolloutLimits(max_bytes=BufferConfig().max_message_bytes))
    from buffers.redis_reader import RedisReader

    return RedisReader(target)


def writer_main(kind: str, target: Any, total: int, go: Any, done: Any) -> None:
    """The generator side, in its own process: waits for ``go``, then puts ``total`` rollouts."""
    writer = make_writer(kind, target)
    template = template_rollout()
    go.wait()
    start = time.perf_counter()
    for first in range(0, total, WRITE_BATCH):
        batch = [
            msgspec.structs.replace(template, rollout_id=f"r{i}", group_id=f"g{i // 8}")
            for i in range(first, min(first + WRITE_BATCH, total))
        ]
        writer.put(batch, timeout_s=60)
    done.put(time.perf_counter() - start)
    time.sleep(0.5)  # ZMQ: LINGER 0 drops what is still queued in the socket at close
    writer.close()


def run_once(kind: str, target: Any, total: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    reader = make_reader(kind, target)
    go, done = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=writer_main, args=(kind, target, total, go, done), daemon=True)
    proc.start()
    time.sleep(1.5 if kind == "zmq" else 0.2)  # spawn + imports; ZMQ also needs the connect to land
    received, gets = 0, 0
    start = time.perf_counter()
    go.set()
    try:
        while received < total:
            got = reader.get(max_items=READ_BATCH, timeout_s=5.0)
            if not got and not proc.is_alive():
                raise RuntimeError(f"{kind}: writer exited after {received}/{total} rollouts")
            received += len(got)
            gets += 1
            reader.ack([r.rollout_id for r in got])
        elapsed = time.perf_counter() - start
        writer_s = done.get(timeout=30)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
        reader.close()
    return {"seconds": elapsed, "writer_seconds": writer_s, "gets": gets}


def free_tcp_address() -> str:
    from redis_server import free_port

    return f"tcp://127.0.0.1:{free_port()}"


def version_of(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "unavailable"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "buffer_bench.json"))
    records.add_argument(parser, "buffer_bench")
    args = parser.parse_args()

    import redis
    import zmq
    from redis_server import RedisServer

    record_bytes = len(encode(template_rollout()))
    print(
        f"record: {PROMPT_TOKENS}+{RESPONSE_TOKENS} tokens, {record_bytes} bytes msgpack; "
        f"{args.rollouts} rollouts per run, writer batch {WRITE_BATCH}, get(max_items={READ_BATCH}) + ack",
        flush=True,
    )
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        plain = RedisServer(Path(tmp) / "plain").start()
        aof = RedisServer(Path(tmp) / "aof", appendonly=True, appendfsync="everysec").start()
        try:

            def redis_target(server: RedisServer, name: str, i: int) -> BufferConfig:
                return BufferConfig(
                    type="redis",
                    redis_url=server.url,
                    stream=f"bench:{name}:{i}",
                    consumer="bench-learner",
                    capacity=CAPACITY,
                    socket_timeout_s=5.0,
                )

            backends = [
                ("zmq", "zmq", lambda i: free_tcp_address()),
                ("redis", "redis", lambda i: redis_target(plain, "redis", i)),
                ("redis-aof-everysec", "redis", lambda i: redis_target(aof, "aof", i)),
            ]
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in backends}
            # Interleaved, so that load from other processes hits every backend alike.
            for i in range(args.repeats):
                for name, kind, target in backends:
                    result = run_once(kind, target(i), args.rollouts)
                    result["rollouts_per_s"] = args.rollouts / result["seconds"]
                    result["mb_per_s"] = args.rollouts * record_bytes / result["seconds"] / 1e6
                    runs[name].append(result)
                    print(
                        f"  {name:<22} run {i + 1}: {result['rollouts_per_s']:>9.0f} rollouts/s "
                        f"{result['mb_per_s']:>7.1f} MB/s  ({result['seconds']:.2f}s)",
                        flush=True,
                    )
        finally:
            plain.stop()
            aof.stop()
    results = []
    for name, rs in runs.items():
        rates = sorted(r["rollouts_per_s"] for r in rs)
        results.append(
            {
                "backend": name,
                "rollouts": args.rollouts,
                "best_rollouts_per_s": rates[-1],
                "median_rollouts_per_s": statistics.median(rates),
                "best_mb_per_s": rates[-1] * record_bytes / 1e6,
                "median_mb_per_s": statistics.median(rates) * record_bytes / 1e6,
                "runs": rs,
            }
        )

    zmq_rate = results[0]["best_rollouts_per_s"]
    zmq_median = results[0]["median_rollouts_per_s"]
    print(f"\n{'backend':<20}{'best/s':>9}{'MB/s':>7}{'vs zmq':>8}{'median/s':>10}{'MB/s':>7}{'vs zmq':>8}")
    for r in results:
        r["ratio_vs_zmq"] = r["best_rollouts_per_s"] / zmq_rate
        r["median_ratio_vs_zmq"] = r["median_rollouts_per_s"] / zmq_median
        print(
            f"{r['backend']:<20}{r['best_rollouts_per_s']:>9.0f}{r['best_mb_per_s']:>7.1f}"
            f"{r['ratio_vs_zmq']:>7.2f}x{r['median_rollouts_per_s']:>10.0f}{r['median_mb_per_s']:>7.1f}"
            f"{r['median_ratio_vs_zmq']:>7.2f}x"
        )
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "versions": {
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "redis-py": redis.__version__,
            "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
            "msgspec": msgspec.__version__,
            "redis-server": version_of([shutil.which("redis-server") or "redis-server", "--version"]),
        },
        "workload": {
            "prompt_tokens": PROMPT_TOKENS,
            "response_tokens": RESPONSE_TOKENS,
            "record_bytes": record_bytes,
            "writer_batch": WRITE_BATCH,
            "reader_max_items": READ_BATCH,
            "capacity": CAPACITY,
            "rollouts_per_run": args.rollouts,
            "repeats": args.repeats,
            "order": "interleaved",
        },
        "results": results,
        "total_seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out} in {report['total_seconds']:.0f}s")
    records.write(args.records, records_of(report, stamp(gpu=False)))


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Rollouts/s of each backend over its repeats, the Redis ones beside ZeroMQ's."""
    rates = {r["backend"]: [run["rollouts_per_s"] for run in r["runs"]] for r in report["results"]}
    settings = {**report["workload"], "hiredis": report["versions"]["hiredis"]}
    return [
        records.measure(
            at,
            bench="buffer_bench",
            case=backend,
            metric="rollouts_per_s",
            unit="rollouts/s",
            repeats=repeats,
            vs=None if backend == "zmq" else records.peer("ZeroMQ", rates["zmq"]),
            settings=settings,
        )
        for backend, repeats in rates.items()
    ]


if __name__ == "__main__":
    main()
