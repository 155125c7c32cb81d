"""How soon a generator in mid-batch hears of a new version, and what asking costs both sides.

    python bench/version_watch_bench.py --out bench/results/version_watch_cpu.json

The learner side is a process of its own: a real :class:`~asyncrl.control.coordinator.Coordinator` served by
its :class:`~asyncrl.control.server.CoordinatorServer`, publishing a version every ``--publish-every-s`` (a
step) while its main thread keeps the interpreter busy, as a learner launching kernels does. The generator side
is this process: an engine step every ``--step-ms`` (a sleep), and between two steps what a generator does to
hear of new weights:

* ``watch`` (the generator's way): looks whether the request the learner holds for it has been answered, and
  if so asks for the version to take;
* ``ask every S s``: a synchronous work request for no tickets every S seconds (0.25: the earlier default
  ``generator.update_poll_s``; 0.05: how often a streaming generator whose bound is full asks for tickets).

The learner process serves requests from a thread, which waits for the interpreter while the main thread
holds it, up to the switch interval each time: serving the coordinator sets 1 ms (Python's default is 5;
``--switch-interval-ms 5`` measures that). Per mode: the delay from a version's publication to the generator
holding it (median and 90th percentile over the versions), how long the engine was held between steps (per
second of run), and how many requests the learner answered per second. Records go to
``bench/records/version_watch_bench.jsonl``, each way of asking beside the watch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import records  # noqa: E402
from bench.provenance import stamp  # noqa: E402

ASKS = (0.25, 0.05)


def learner(address: str, versions: int, every_s: float, switch_s: float | None, ready, out) -> None:
    """Publish ``versions`` versions ``every_s`` apart with the interpreter busy between; send back when each
    went out (wall clock) and how many requests were answered."""
    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.server import CoordinatorServer
    from asyncrl.control.staleness import StalenessBound
    from asyncrl.wire.protocol import WeightUpdate

    coordinator = Coordinator(StalenessBound(1, 128), PromptCursor(1000, seed=0), 8, 60.0, "bench")
    answered = [0]
    handle = coordinator.handle_work

    def counted(request, final=True):
        answered[0] += 1
        return handle(request, final)

    coordinator.handle_work = counted
    server = CoordinatorServer(coordinator, address, lambda: None, max_hold_s=1.0)
    if switch_s:  # in place of the serving process's own
        sys.setswitchinterval(switch_s)
    ready.set()
    published = []
    started = time.monotonic()
    for version in range(1, versions + 1):
        deadline = started + version * every_s
        while time.monotonic() < deadline:
            sum(range(2000))  # the learner's host work: the interpreter stays busy
        coordinator.publish(WeightUpdate(version=version, uri=f"file:///v{version}"))
        published.append(time.time())
    spin_until = time.monotonic() + 0.5  # the last version's delay is measured too
    while time.monotonic() < spin_until:
        sum(range(2000))
    out.put({"published": published, "answered": answered[0], "seconds": time.monotonic() - started})
    server.close()


def generator(address: str, mode: str, seconds: float, step_s: float, session: str) -> dict[str, Any]:
    """Engine steps for ``seconds``, hearing of versions by ``mode``; when each version was first held."""
    from asyncrl.control.client import CoordinatorClient
    from asyncrl.wire.protocol import WorkReply, WorkRequest

    client = CoordinatorClient(address, timeout_s=5.0)
    held = [0]

    def request(wait_s: float) -> WorkRequest:
        return WorkRequest(
            generator_id="g", weight_version=held[0], weight_session=session, max_groups=0, wait_s=wait_s
        )

    watch = client.watch(lambda: request(1.0), hold_s=1.0) if mode == "watch" else None
    ask_every = None if mode == "watch" else float(mode)
    heard: dict[int, float] = {}
    between_s, last_ask = 0.0, time.monotonic()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(step_s)  # an engine step
        started = time.perf_counter()
        if watch is not None:  # as a generator: once the watch is answered, the version to take is asked for
            reply = client.call(request(0.0), WorkReply) if watch.newest() is not None else None
        elif time.monotonic() - last_ask >= ask_every:
            reply, last_ask = client.call(request(0.0), WorkReply), time.monotonic()
        else:
            reply = None
        if reply is not None and reply.latest is not None and reply.latest.version > held[0]:
            held[0] = reply.latest.version
            heard[held[0]] = time.time()
        between_s += time.perf_counter() - started
    client.close()
    return {"heard": heard, "between_s": between_s}


def run_mode(mode: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    address = f"tcp://127.0.0.1:{port}"
    context = multiprocessing.get_context("spawn")
    ready, out = context.Event(), context.Queue()
    switch_s = args.switch_interval_ms / 1000 if args.switch_interval_ms else None
    side = context.Process(target=learner, args=(address, args.versions, args.publish_every_s, switch_s, ready, out))
    side.start()
    ready.wait(60)
    seconds = args.versions * args.publish_every_s + 0.5
    got = generator(address, mode, seconds, args.step_ms / 1000, "bench")
    learned = out.get(timeout=60)
    side.join(30)
    delays = [got["heard"][v] - t for v, t in enumerate(learned["published"], 1) if v in got["heard"]]
    return {
        "versions_heard": len(delays),
        "delay_ms": [d * 1000 for d in delays],
        "engine_held_ms_per_s": got["between_s"] * 1000 / seconds,
        "requests_per_s": learned["answered"] / learned["seconds"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=60)
    parser.add_argument("--publish-every-s", type=float, default=0.3, help="a learner step")
    parser.add_argument("--step-ms", type=float, default=3.0, help="an engine step")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the learner process's interpreter switch interval (default: what serving the coordinator sets)",
    )
    parser.add_argument("--out", default="bench/results/version_watch_bench.json")
    records.add_argument(parser, "version_watch_bench")
    args = parser.parse_args()
    from asyncrl.wire.ports import free_port

    modes = {"watch": "watch", **{f"ask every {s:g} s": f"{s}" for s in ASKS}}
    results = {name: run_mode(mode, args, free_port()) for name, mode in modes.items()}
    at = stamp()
    report = {"what": __doc__.split("\n")[0], "machine": at.machine, "date": at.date, "modes": results}
    from asyncrl.control.server import SWITCH_INTERVAL_S

    switch_ms = args.switch_interval_ms or SWITCH_INTERVAL_S * 1000
    report.update(versions=args.versions, publish_every_s=args.publish_every_s, step_ms=args.step_ms)
    report.update(switch_interval_ms=switch_ms)
    for name, result in results.items():
        delays = sorted(result["delay_ms"])
        print(
            f"{name:>16}: delay median {statistics.median(delays):6.1f} ms (p90 {delays[int(0.9 * len(delays))]:6.1f}),"
            f" engine held {result['engine_held_ms_per_s']:5.2f} ms/s, learner answered {result['requests_per_s']:6.1f}"
            f" requests/s, {result['versions_heard']}/{args.versions} versions heard"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    records.write(args.records, records_of(report, at))
    return 0


def records_of(report: dict[str, Any], at: records.Stamp) -> list[records.Record]:
    """Per way of asking: the delay to hear of a version, the engine's hold and the learner's requests, each
    beside the watch's."""
    case = (
        f"a version every {report['publish_every_s']:g} s, an engine step every {report['step_ms']:g} ms, "
        f"learner switch interval {report['switch_interval_ms']:g} ms"
    )
    watch = report["modes"]["watch"]
    out = []

    def repeats(result: dict[str, Any]) -> dict[str, tuple[str, list[float]]]:
        return {
            "delay_ms": ("ms", result["delay_ms"]),
            "engine_held_ms_per_s": ("ms/s", [result["engine_held_ms_per_s"]]),
            "learner_requests_per_s": ("requests/s", [result["requests_per_s"]]),
        }

    for name, result in report["modes"].items():
        for metric, (unit, values) in repeats(result).items():
            against = None if name == "watch" else repeats(watch)[metric][1]
            out.append(
                records.measure(
                    at,
                    bench="version_watch_bench",
                    case=f"{case}, {name}",
                    metric=metric,
                    unit=unit,
                    higher_is_better=False,
                    repeats=values,
                    vs=records.peer("watch", against, higher_is_better=False) if against else None,
                )
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
