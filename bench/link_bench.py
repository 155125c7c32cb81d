"""Slow and lossy links between a generator and the learner: samples/s against the clean link (run as root).

Three hosts on one machine (``scripts/hosts.py``): the learner on h1, one
generator on h2, and on h3 a user-space TCP relay that h2 reaches h1 through
(its buffer, coordinator and weight server alike). The relay adds ``delay``
to each direction and, with probability ``loss`` per chunk read, holds a
chunk back for one retransmission timeout (0.2 s, Linux's least) with every
chunk behind it: what a lost segment costs a TCP stream, whose bytes arrive
late and in order, never missing. The kernel's netem would shape packets
instead; this machine has none. Each case runs the CPU quickstart for
``--train-s`` seconds of training; ``direct`` is h2 talking to h1 without
the relay. A case ending in ``:reset`` has the relay reset every connection
it carries once, halfway through training (each end gets a TCP RST, as from
a middlebox that dropped its state), and reports how long the learner then
went without a step.

Each case runs ``--repeats`` times, the cases interleaved; every repeat's
samples/s (and its longest wait between two steps in the second half of
training) goes to ``bench/records/link_bench.jsonl`` beside the direct
link's, the first case.

    python bench/link_bench.py                                  # direct, relay 0/10/50 ms, 2% held, a reset
    python bench/link_bench.py --cases direct 0:0 25:0.05 --repeats 3 --out bench/results/link_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, the repository root is not
    sys.path.insert(0, str(ROOT))

from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

CONFIG = str(ROOT / "configs/quickstart.yaml")
PORTS = (5555, 5556, 5557)  # buffer, coordinator, weight server
RTO_S = 0.2  # TCP's least retransmission timeout on Linux: the wait a lost segment costs at best
CHUNK_BYTES = 65536


# ---------------------------------------------------------------- the relay, run on its own host
async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, loss: float, rng) -> None:
    """Copy one direction, each chunk ``delay_s`` late (plus RTO_S for a "lost" one), in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                break
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    last_due = 0.0
    try:
        while data := await reader.read(CHUNK_BYTES):
            # In order: a chunk held back holds back every chunk behind it, as in a TCP stream.
            last_due = max(last_due, loop.time() + delay_s + (RTO_S if rng.random() < loss else 0.0))
            queue.put_nowait((last_due, data))
    except ConnectionError:
        pass
    queue.put_nowait((last_due, b""))
    await sender


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP RST: SO_LINGER on with a zero timeout, then an abort."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _relay(listen: str, target: str, delay_s: float, loss: float, seed: int) -> None:
    rng = random.Random(seed)
    open_writers: set[asyncio.StreamWriter] = set()

    def reset_all() -> None:  # SIGUSR1: every connection carried so far, both ends; new ones are taken as before
        print(f"resetting {len(open_writers)} connection ends", flush=True)
        for writer in list(open_writers):
            _reset(writer)
        open_writers.clear()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, reset_all)

    async def serve(port: int):
        async def connection(client_reader, client_writer) -> None:
            try:
                server_reader, server_writer = await asyncio.open_connection(target, port)
            except OSError:
                client_writer.close()
                return
            open_writers.update((client_writer, server_writer))
            await asyncio.gather(
                _pipe(client_reader, server_writer, delay_s, loss, rng),
                _pipe(server_reader, client_writer, delay_s, loss, rng),
                return_exceptions=True,
            )
            open_writers.difference_update((client_writer, server_writer))

        return await asyncio.start_server(connection, listen, port)

    servers = [await serve(port) for port in PORTS]
    print(f"relaying {listen} -> {target} on {PORTS}: +{delay_s * 1000:g} ms each way, {loss:.1%} held", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


# ---------------------------------------------------------------- one case: a short run across the hosts
class StepTimes:
    """The learner's steps as they appear in its ``metrics.jsonl``: when each was first seen (monotonic s)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen, self.train_s, self._offset = path, [], 0.0, 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as file:
            file.seek(self._offset)
            text = file.read()
        whole = text[: text.rfind("\n") + 1]  # a line being written is read next time
        self._offset += len(whole)
        now = time.monotonic()
        for line in whole.splitlines():
            self.seen.append(now)
            self.train_s = json.loads(line)["wall_s"]

    def longest_gap_s(self, since: float) -> float:
        """The longest wait between two steps (or from ``since`` to the first) among the steps after ``since``."""
        times = [since, *(t for t in self.seen if t > since)]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def run_case(hosts, delay_ms: float | None, loss: float, train_s: float, out: Path, reset: bool = False) -> dict:
    """The quickstart across ``hosts`` (learner h1, generator h2, relay h3), through the relay unless
    ``delay_ms`` is None (with ``reset``, the relay resets its connections halfway); what the learner's summary
    says of it, and the longest wait between two steps in the second half of training."""
    a, b, relay = hosts["h1"], hosts["h2"], hosts["h3"]
    via = a.address if delay_ms is None else relay.address
    settings = [
        f"--model.path={ROOT / 'assets/tiny-llama'}",
        "--buffer.curve_secret_file=secrets/run.key_secret",
        "--coordinator.curve_secret_file=secrets/run.key_secret",
        "--learner.total_steps=100000",
        f"--learner.max_train_s={train_s}",
        "--learner.torch_threads=1",
        "--generator.torch_threads=1",
    ]

    def addresses(host: str) -> list[str]:
        names = ("buffer.address", "coordinator.address", "coordinator.weights_address")
        return [f"--{name}=tcp://{host}:{port}" for name, port in zip(names, PORTS)]

    relay_proc = None
    if delay_ms is not None:
        relay_args = [
            sys.executable,
            str(Path(__file__).resolve()),
            "relay",
            relay.address,
            a.address,
            str(delay_ms),
            str(loss),
        ]
        relay_proc = relay.popen(relay_args, out / "relay.log")
    env = {"PYTHONUNBUFFERED": "1"}
    learner = a.popen(
        ["asyncrl-learner", CONFIG, "--run-dir", "run", *settings, *addresses(a.address)], out / "h1.log", env
    )
    generator = b.popen(
        ["asyncrl-generator", CONFIG, "--generator-id", "h2", *settings, *addresses(via)], out / "h2.log", env
    )
    steps = StepTimes(a.folder / "run" / "metrics.jsonl")
    half_at = reset_step = None
    deadline = time.monotonic() + train_s + 300
    try:
        while learner.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the learner did not end within {train_s + 300:g}s")
            steps.poll()
            if half_at is None and steps.train_s >= train_s / 2:
                half_at, reset_step = time.monotonic(), len(steps.seen)
                if reset:
                    os.kill(relay_proc.pid, signal.SIGUSR1)
            time.sleep(0.02)  # real time: the run itself, watched as it goes
        steps.poll()
        if learner.returncode != 0:
            raise RuntimeError((out / "h1.log").read_text()[-3000:])
    finally:
        for proc in [learner, generator, relay_proc]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    summary = json.loads((a.folder / "run" / "summary.json").read_text())
    generator_log = (out / "h2.log").read_text(errors="replace")
    link = "direct" if delay_ms is None else f"relay +{delay_ms:g} ms, {loss:.0%} held"
    return {
        "link": link + (", reset once" if reset else ""),
        "delay_ms": delay_ms,
        "loss": loss,
        "reset": reset,
        "steps": summary["steps"],
        "samples_per_s": summary["achieved_samples_per_s"],
        "samples_dropped": summary["samples_dropped"],
        "slots_released": summary["slots_released"],
        # From halfway (the reset, where there is one) to the end of training.
        "longest_step_gap_s": steps.longest_gap_s(half_at) if half_at is not None else None,
        "steps_after_half": len(steps.seen) - reset_step if reset_step is not None else 0,
        "generator_waited": generator_log.count("waiting for the learner"),
        "generator_fetches_cut": generator_log.count("dropped before it answered"),
    }


def parse_case(case: str) -> tuple[float | None, float, bool]:
    """``direct``, ``DELAY_MS:LOSS`` or ``DELAY_MS:LOSS:reset``: the relay's delay (None: no relay), loss and reset."""
    if case == "direct":
        return None, 0.0, False
    delay_ms, loss, *rest = case.split(":")
    if rest not in ([], ["reset"]):
        raise ValueError(f"case {case!r}: expected direct, DELAY_MS:LOSS or DELAY_MS:LOSS:reset")
    return float(delay_ms), float(loss), rest == ["reset"]


def records_of(report: dict, at: records.Stamp, notes: str) -> list[records.Record]:
    """Each case's samples/s and longest step gap over its repeats, beside the first case's (the direct link)."""
    by_case: dict[str, list[dict]] = {}
    for result in report["results"]:
        by_case.setdefault(result["link"], []).append(result)
    first = next(iter(by_case))
    out = []
    for link, runs in by_case.items():
        settings = {
            "delay_ms": runs[0]["delay_ms"],
            "loss": runs[0]["loss"],
            "reset": runs[0]["reset"],
            "train_s": report["train_s"],
            "rto_s": RTO_S,
            "config": "configs/quickstart.yaml",
        }
        for metric, unit, better in (
            ("samples_per_s", "samples/s", True),
            ("longest_step_gap_s", "s", False),
        ):
            peer = None if link == first else records.peer(first, [r[metric] for r in by_case[first]], better)
            out.append(
                records.measure(
                    at,
                    bench="link_bench",
                    case=link,
                    metric=metric,
                    unit=unit,
                    repeats=[r[metric] for r in runs],
                    higher_is_better=better,
                    vs=peer,
                    settings=settings,
                    notes=notes,
                )
            )
    return out


def _load() -> str:
    """The load averages over 1, 5 and 15 minutes, as ``uptime`` shows them."""
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        listen, target, delay_ms, loss = argv[1:5]
        asyncio.run(_relay(listen, target, float(delay_ms) / 1000, float(loss), seed=0))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["direct", "0:0", "10:0", "50:0", "0:0.02", "0:0:reset"],
        help="direct, DELAY_MS:LOSS or DELAY_MS:LOSS:reset (the first is the others' peer)",
    )
    parser.add_argument("--train-s", type=float, default=20.0, help="seconds of training per case")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case, the cases interleaved")
    parser.add_argument("--out", type=Path, default=None, help="also write the results here (JSON)")
    records.add_argument(parser, "link_bench")
    args = parser.parse_args(argv)
    cases = [(case, *parse_case(case)) for case in args.cases]
    sys.path.insert(0, str(ROOT / "scripts"))
    from hosts import Hosts

    load_before, started = _load(), time.monotonic()
    results = []
    for repeat in range(args.repeats):
        for _, delay_ms, loss, reset in cases:
            with Hosts() as hosts:
                hosts.up(3)
                keys = hosts["h1"].command(["asyncrl", "keys", "secrets/run"])
                subprocess.run(keys, check=True, capture_output=True, timeout=120)
                hosts.copy("h1", "secrets", ["h2"])
                results.append({"repeat": repeat, **run_case(hosts, delay_ms, loss, args.train_s, hosts.root, reset)})
            result, clean = results[-1], results[0]["samples_per_s"]
            print(
                f"{result['link']:>34}: {result['samples_per_s']:7.0f} samples/s "
                f"({result['samples_per_s'] / clean:.2f}x the first case), {result['steps']} steps, "
                f"longest step gap after halfway {result['longest_step_gap_s']:.2f}s",
                flush=True,
            )
    notes = (
        f"load average (1, 5, 15 min) {load_before} before, {_load()} after "
        f"{time.monotonic() - started:.0f}s of runs; 2 cores shared with other work"
    )
    report = {"train_s": args.train_s, "repeats": args.repeats, "notes": notes, "results": results}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    records.write(args.records, records_of(report, stamp(gpu=False), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
