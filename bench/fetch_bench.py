"""A version fetched from the learner's weight server over a link with delay, chunks asked for a window at a time.

Publishes one version of ``--mb`` MB, serves it on loopback, and puts
``bench/link_bench.py``'s relay in front of it (delay added each way, on
127.0.0.2); then fetches the whole version through the relay (into
/dev/shm, so that the disk's write-back does not blur the link) with
``FETCH_WINDOW`` chunk requests in flight, beside one at a time (the fetch
before windows), the two interleaved. Appends seconds per version to
``bench/records/fetch_bench.jsonl``.

    python bench/fetch_bench.py --delays 0 2 10 --mb 256
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.weights import folders, served  # noqa: E402
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

SERVER, RELAY, PORT = "127.0.0.1", "127.0.0.2", 5557  # the relay carries link_bench's ports, 5557 the weights'
WINDOW = served.FETCH_WINDOW


def _relay(delay_ms: float) -> subprocess.Popen:
    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/link_bench.py"), "relay", RELAY, SERVER, str(delay_ms), "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert relay.stdout is not None and "relaying" in relay.stdout.readline(), "the relay did not start"
    return relay


def _fetch_s(window: int, cache: Path) -> float:
    served.FETCH_WINDOW = window
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    served.fetch(1, f"tcp://{RELAY}:{PORT}", cache, timeout_s=120)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 2.0, 10.0], help="ms added each way")
    parser.add_argument("--mb", type=int, default=256, help="the version's size")
    parser.add_argument("--repeats", type=int, default=3)
    records.add_argument(parser, "fetch_bench")
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        if probe.connect_ex((SERVER, PORT)) == 0:
            parser.error(f"{SERVER}:{PORT} is taken: the relay needs it")
    # In memory where there is /dev/shm: the disk's write-back would stall some fetches more than the link does.
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="fetch-bench-", dir=shm if shm.is_dir() else None))
    try:
        weights = torch.randn(args.mb * 2**20 // 4)
        folders.publish(
            [("w", weights)],
            version=1,
            weights_dir=work / "learner",
            model_dir=ROOT / "assets/tiny-llama",
            config_json="{}",
        )
        server = served.WeightServer(work / "learner", f"tcp://{SERVER}:{PORT}", deltas=False)
        out = []
        try:
            for delay in args.delays:
                relay = _relay(delay)
                try:
                    runs = {WINDOW: [], 1: []}
                    for _ in range(args.repeats):
                        for window in runs:
                            runs[window].append(_fetch_s(window, work / "cache"))
                    print(f"+{delay:g} ms each way: {runs}", flush=True)
                finally:
                    relay.terminate()
                    relay.wait(timeout=10)
                out.append(
                    records.measure(
                        stamp(),
                        bench="fetch_bench",
                        case=f"{args.mb} MB, +{delay:g} ms each way",
                        metric="fetch_s",
                        unit="s",
                        repeats=runs[WINDOW],
                        higher_is_better=False,
                        vs=records.peer("one chunk at a time", runs[1]),
                        settings={"mb": args.mb, "delay_ms": delay, "window": WINDOW, "chunk_mb": 8},
                    )
                )
        finally:
            server.close()
        records.write(args.records, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
