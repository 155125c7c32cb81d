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
the relay.

    python bench/link_bench.py                                  # direct, relay 0/10/50 ms, 0 ms with 2% loss
    python bench/link_bench.py --cases direct 0:0 25:0.05 --out bench/results/link_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


async def _relay(listen: str, target: str, delay_s: float, loss: float, seed: int) -> None:
    rng = random.Random(seed)

    async def serve(port: int):
        async def connection(client_reader, client_writer) -> None:
            try:
                server_reader, server_writer = await asyncio.open_connection(target, port)
            except OSError:
                client_writer.close()
                return
            await asyncio.gather(
                _pipe(client_reader, server_writer, delay_s, loss, rng),
                _pipe(server_reader, client_writer, delay_s, loss, rng),
                return_exceptions=True,
            )

        return await asyncio.start_server(connection, listen, port)

    servers = [await serve(port) for port in PORTS]
    print(f"relaying {listen} -> {target} on {PORTS}: +{delay_s * 1000:g} ms each way, {loss:.1%} held", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


# ---------------------------------------------------------------- one case: a short run across the hosts
def run_case(hosts, delay_ms: float | None, loss: float, train_s: float, out: Path) -> dict:
    """The quickstart across ``hosts`` (learner h1, generator h2, relay h3), through the relay unless
    ``delay_ms`` is None; what the learner's summary says of it."""
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

    procs = []
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
        procs.append(relay.popen(relay_args, out / "relay.log"))
    learner = a.popen(["asyncrl-learner", CONFIG, "--run-dir", "run", *settings, *addresses(a.address)], out / "h1.log")
    procs.append(
        b.popen(["asyncrl-generator", CONFIG, "--generator-id", "h2", *settings, *addresses(via)], out / "h2.log")
    )
    try:
        if learner.wait(timeout=train_s + 300) != 0:
            raise RuntimeError((out / "h1.log").read_text()[-3000:])
    finally:
        for proc in [learner, *procs]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    summary = json.loads((a.folder / "run" / "summary.json").read_text())
    return {
        "link": "direct" if delay_ms is None else f"relay +{delay_ms:g} ms, {loss:.0%} held",
        "delay_ms": delay_ms,
        "loss": loss,
        "steps": summary["steps"],
        "samples_per_s": summary["achieved_samples_per_s"],
        "samples_dropped": summary["samples_dropped"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        listen, target, delay_ms, loss = argv[1:5]
        asyncio.run(_relay(listen, target, float(delay_ms) / 1000, float(loss), seed=0))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases", nargs="+", default=["direct", "0:0", "10:0", "50:0", "0:0.02"], help="direct, or DELAY_MS:LOSS"
    )
    parser.add_argument("--train-s", type=float, default=20.0, help="seconds of training per case")
    parser.add_argument("--out", type=Path, default=None, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "scripts"))
    from hosts import Hosts

    results = []
    for case in args.cases:
        delay_ms, loss = (None, 0.0) if case == "direct" else map(float, case.split(":"))
        with Hosts() as hosts:
            hosts.up(3)
            subprocess.run(hosts["h1"].command(["asyncrl", "keys", "secrets/run"]), check=True, capture_output=True)
            hosts.copy("h1", "secrets", ["h2"])
            results.append(run_case(hosts, delay_ms, loss, args.train_s, hosts.root))
        clean = results[0]["samples_per_s"]
        print(
            f"{results[-1]['link']:>28}: {results[-1]['samples_per_s']:7.0f} samples/s "
            f"({results[-1]['samples_per_s'] / clean:.2f}x the first case), {results[-1]['steps']} steps",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"train_s": args.train_s, "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
