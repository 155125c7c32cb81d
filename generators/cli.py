"""``asyncrl-generator CONFIG``: one generator process (or ``--replicas N`` of them).

SIGTERM drains: the generator finishes and writes the groups it holds, takes
no new tickets, tells the learner it leaves, and exits 0 (``asyncrl scale``
removes generators this way, so nothing they were given waits out
``coordinator.generator_lease_s``). A second SIGTERM ends it at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import zlib
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.observe.prometheus import MetricsEndpoint
    from generators.worker import GeneratorWorker

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    from asyncrl.config import describe_keys

    parser = argparse.ArgumentParser(
        prog="asyncrl-generator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=describe_keys(
            ["run_dir", "trace", "model", "task", "buffer", "coordinator", "generator", "eval", "push", "prometheus"]
        )
        + "\n\nFrom the learner's section it reads learner.shared_weights, learner.devices and learner.ranks,\n"
        "which decide whether weights are handed over on one GPU (see asyncrl-learner --help).",
    )
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("--generator-id", default=None, help="unique id; default host-pid")
    parser.add_argument("--replicas", type=int, default=None, help="start N generator processes")
    parser.add_argument("--produced-log", default=None, help="append the id of every rollout written to this file")
    args, overrides = parser.parse_known_args(argv)

    from asyncrl.config import ConfigError, check_secrets, load_config

    try:
        config = load_config(args.config, overrides)
        check_secrets(config, learner=False)
    except ConfigError as exc:
        print(f"asyncrl-generator: {exc}", file=sys.stderr)
        return 2
    replicas = args.replicas if args.replicas is not None else 1
    if replicas > 1:
        return _run_replicas(args, config, overrides, replicas)
    return _run_one(config, args.generator_id or f"{socket.gethostname()}-{os.getpid()}", args.produced_log)


def _run_one(config: RunConfig, generator_id: str, produced_log: str | None) -> int:
    """One generator process: open the backend, the task, the learner's coordinator and the buffer, then work."""
    from asyncrl.observe import logs

    log = logs.setup(f"generator[{generator_id}]")
    if config.trace:
        from asyncrl.observe import trace

        trace.configure(config.run_dir, f"generator {generator_id}")
    import torch

    from asyncrl.control.client import CoordinatorClient
    from asyncrl.extras import MissingExtra
    from asyncrl.tasks import open_task
    from buffers import open_writer
    from generators import open_backend
    from generators.episodes import open_episodes
    from generators.worker import GeneratorWorker

    if config.generator.torch_threads:
        torch.set_num_threads(config.generator.torch_threads)
    torch.manual_seed(config.generator.seed + zlib.crc32(generator_id.encode()))
    try:
        backend = open_backend(config)
    except MissingExtra as exc:
        print(f"asyncrl-generator: {exc}", file=sys.stderr)
        return 2
    task = open_task(config.prompt_task(), backend.tokenizer)
    client = CoordinatorClient(
        config.coordinator.address, config.coordinator.timeout_s, config.coordinator.curve_secret_file
    )
    writer = open_writer(config.buffer)
    episodes = open_episodes(config, backend)
    worker = GeneratorWorker(
        config,
        generator_id,
        backend,
        prompt_ids=task.prompt_ids,
        items=task.items,
        reward_fn=task.reward,
        client=client,
        writer=writer,
        eval_items=task.eval_items,
        episodes=episodes,
    )
    if produced_log:
        worker.produced_log = open(produced_log, "a")
    endpoint = _metrics_endpoint(config, worker, generator_id)
    if endpoint is not None:
        log.info("metrics on http://%s:%d/metrics", config.prometheus.host, endpoint.port)
    drain_on_sigterm(worker)
    try:
        worker.run()
    except TimeoutError as exc:
        if not worker.draining:
            log.error("%s", exc)
            return 1
        log.warning("%s: stopping while draining: %s", generator_id, exc)
    finally:
        if endpoint is not None:
            endpoint.close()
        writer.close()
        client.close()
        if episodes is not None:
            episodes.close()
        backend.close()
    return 0


def _metrics_endpoint(config: RunConfig, worker: GeneratorWorker, generator_id: str) -> MetricsEndpoint | None:
    """The worker's Prometheus ``/metrics``, where ``prometheus.generator_port`` is set."""
    if config.prometheus.generator_port is None:
        return None
    from asyncrl.observe.prometheus import MetricsEndpoint

    return MetricsEndpoint(
        config.prometheus.host,
        config.prometheus.generator_port,
        worker.prometheus_metrics,
        {"generator": generator_id},
        config.prometheus.secret_file,
        "prometheus.generator_port",
    )


def drain_on_sigterm(worker: GeneratorWorker) -> None:
    """The first SIGTERM drains ``worker``; a second one ends the process at once.

    The handler only sets the worker's flag and restores the default action:
    logging from a signal handler can re-enter a stream the main thread is
    writing to. The worker logs when it acts on the flag.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        worker.drain()

    signal.signal(signal.SIGTERM, handler)


def _run_replicas(args: argparse.Namespace, config, overrides: list[str], replicas: int) -> int:
    """Start ``replicas`` single generators, each with its own id, and wait for all."""
    from asyncrl.tasks import child_env

    base = args.generator_id or socket.gethostname()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "generators.cli",
                args.config,
                "--generator-id",
                f"{base}-{i}",
                *overrides,
                *config.replica_overrides(i),
            ],
            env=child_env(),
        )
        for i in range(replicas)
    ]
    try:
        return max(p.wait() for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()


if __name__ == "__main__":
    sys.exit(main())
