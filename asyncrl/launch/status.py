"""``asyncrl status``: what a running learner says of its run, once or every second (``--watch``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def command(args: argparse.Namespace, overrides: list[str]) -> int:
    """``asyncrl status CONFIG|RUN_DIR [--watch] [--json]``: ask the learner, print what it says."""
    from asyncrl.config import load_config
    from asyncrl.control.client import CoordinatorClient
    from asyncrl.wire.protocol import Status, StatusRequest

    path = Path(args.config)
    if path.is_dir():  # a run folder: its config has the run's own ports
        if not (path / "config.yaml").exists():
            raise FileNotFoundError(
                f"{path} has no config.yaml (a run writes it as it starts): give the run's "
                "config file, or wait for the run to start"
            )
        path = path / "config.yaml"
    config = load_config(path, overrides)
    client = CoordinatorClient(
        args.address or config.coordinator.address, config.coordinator.timeout_s, config.coordinator.curve_secret_file
    )
    if args.watch:
        signal.signal(signal.SIGINT, _end_watch)
    try:
        while True:
            try:
                snapshot = client.call(StatusRequest(), Status)
            except TimeoutError as exc:
                ended = Path(config.run_dir) / "summary.json"
                if ended.exists():
                    at = time.strftime("%Y-%m-%d %H:%M", time.localtime(ended.stat().st_mtime))
                    exc = TimeoutError(
                        f"{exc} (a run in {config.run_dir} ended at {at}: {ended}; if another "
                        "runs there now, check the address and coordinator.curve_secret_file)"
                    )
                elif not config.coordinator.curve_secret_file:
                    exc = TimeoutError(
                        f"{exc}: is it running? A learner that listens beyond loopback answers only "
                        "with the run's secret (--coordinator.curve_secret_file), which `asyncrl "
                        "status RUN_DIR` reads from the run's own config"
                    )
                if not args.watch:
                    raise exc from None
                # Watching outlives a learner's restart (or its slow start): say so, and ask again.
                print(f"{time.strftime('%H:%M:%S')} no answer: {exc}; asking again (Ctrl-C to stop)", flush=True)
                continue
            if config.coordinator.run_id and snapshot.run_id and snapshot.run_id != config.coordinator.run_id:
                other = (
                    f"the learner at {args.address or config.coordinator.address} serves run {snapshot.run_id}, "
                    f"not {config.coordinator.run_id} (coordinator.run_id): the run in {config.run_dir} has ended"
                )
                if not args.watch:
                    raise RuntimeError(other)
                print(f"{time.strftime('%H:%M:%S')} {other}; asking again (Ctrl-C to stop)", flush=True)
                time.sleep(1.0)
                continue
            if args.json:
                import msgspec

                print(json.dumps(msgspec.to_builtins(snapshot)))
            else:
                print(format_status(snapshot), flush=True)
            if not args.watch:
                return 0
            time.sleep(1.0)
            print("\033[2J\033[H", end="")
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _end_watch(*_: object) -> None:
    """Ctrl-C ends ``asyncrl status --watch`` at once, wherever it lands. The watch holds nothing to clean up,
    and once a Ctrl-C that landed mid-reconnect left the process waiting in ZeroMQ's teardown at exit."""
    sys.stdout.flush()
    os._exit(0)


def _number(value: float) -> str:
    """A count as a count (3,514,680, not 3.51468e+06); anything else to 3 significant digits."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.3g}"


def format_status(s) -> str:
    """A human-readable view of a :class:`~asyncrl.wire.protocol.Status` snapshot."""
    elapsed = s.now_s - s.started_s
    reward = f"{s.reward:.3f}" if s.reward is not None else "-"
    lines = [
        f"step {s.step}/{s.total_steps}  version {s.version}  reward {reward}  up {elapsed:.0f}s",
        f"samples: consumed {s.samples_consumed}  admitted {s.samples_admitted}  dropped {s.samples_dropped}",
        f"rejected entries: {s.rejected or 'none'}",
        f"staleness bound {s.max_staleness}  trained "
        + (f"{s.samples_per_s:.1f} samples/s" if s.samples_per_s is not None else "- samples/s (no step yet)"),
        "buffer: "
        + "  ".join(
            f"{k} {_number(v)}" for k, v in s.buffer.items() if k not in ("waiting", "oldest_waiting_staleness")
        ),
        f"waiting for a batch: {s.buffer.get('waiting', 0):g} samples, oldest "
        + (
            f"{s.buffer['oldest_waiting_staleness']:g} versions behind"
            if "oldest_waiting_staleness" in s.buffer
            else "-"
        ),
        f"generators ({len(s.generators)}):",
    ]
    for g in s.generators:
        rate = g.samples_generated / g.busy_s if g.busy_s else 0.0
        age = s.now_s - g.last_seen_s
        # Generators ask for work at least once per batch; one quiet for a lease is presumed dead.
        state = "alive" if age < s.generator_lease_s / 4 else "quiet" if age < s.generator_lease_s else "lost"
        lines.append(
            f"  {g.generator_id:<20} {state:<5} v{g.weight_version:<5} {g.samples_generated:>8} samples "
            f"{rate:8.1f}/s busy  seen {age:.1f}s ago"
        )
    return "\n".join(lines)
