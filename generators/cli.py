"""``asyncrl-generator CONFIG``: one generator process (or ``--replicas N`` of them).

SIGTERM drains: the generator finishes and writes the groups it holds, takes
no new tickets, and exits 0 (``asyncrl scale`` removes generators this way,
so nothing they were given waits out ``coordinator.generator_lease_s``).
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

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    from asyncrl.config import describe_keys

    parser = argparse.ArgumentParser(
        prog="asyncrl-generator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=describe_keys(["trace", "model", "task", "buffer", "coordinator", "generator", "push", "prometheus"]))
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("--generator-id", default=None, help="unique id; default host-pid")
    parser.add_argument("--replicas", type=int, default=None, help="start N generator processes")
    parser.add_argument("--produced-log", default=None, help="append the id of every rollout written to this file")
    args, overrides = parser.parse_known_args(argv)

    from asyncrl.config import load_config

    config = load_config(args.config, overrides)
    replicas = args.replicas if args.replicas is not None else 1
    if replicas > 1:
        return _run_replicas(args, config, overrides, replicas)
    generator_id = args.generator_id or f"{socket.gethostname()}-{os.getpid()}"

    from asyncrl import logs

    log = logs.setup(f"generator[{generator_id}]")
    if config.trace:
        from asyncrl import trace

        trace.configure(config.run_dir, f"generator {generator_id}")
    import torch

    from asyncrl.coordinator import CoordinatorClient
    from asyncrl.extras import MissingExtra
    from asyncrl.tasks import open_task
    from buffers import open_writer
    from generators import open_backend
    from generators.worker import GeneratorWorker

    if config.generator.torch_threads:
        torch.set_num_threads(config.generator.torch_threads)
    torch.manual_seed(config.generator.seed + zlib.crc32(generator_id.encode()))
    try:
        backend = open_backend(config)
    except MissingExtra as exc:
        print(f"asyncrl-generator: {exc}", file=sys.stderr)
        return 2
    task = open_task(config.task, backend.tokenizer)
    client = DrainingClient(CoordinatorClient(config.coordinator.address, config.coordinator.timeout_s,
                                              config.coordinator.curve_secret_file), generator_id)
    writer = open_writer(config.buffer)
    worker = GeneratorWorker(
        config, generator_id, backend,
        prompt_ids=task.prompt_ids,
        items=task.items,
        reward_fn=task.reward,
        client=client,
        writer=writer,
        eval_items=task.eval_items,
    )
    if args.produced_log:
        worker.produced_log = open(args.produced_log, "a")
    endpoint = None
    if config.prometheus.generator_port is not None:
        from asyncrl.prometheus import MetricsEndpoint

        endpoint = MetricsEndpoint(config.prometheus.host, config.prometheus.generator_port, worker.prometheus_metrics,
                                   {"generator": generator_id}, config.prometheus.secret_file,
                                   "prometheus.generator_port")
        log.info("metrics on http://%s:%d/metrics", config.prometheus.host, endpoint.port)
    signal.signal(signal.SIGTERM, client.drain)
    try:
        worker.run()
    except DrainInterrupted as exc:
        log.warning("%s", exc)
    except TimeoutError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if endpoint is not None:
            endpoint.close()
        writer.close()
        client.close()
        backend.close()
    return 0


class DrainInterrupted(RuntimeError):
    """A draining generator could not reach the learner: it stops without finishing its batch."""


class DrainingClient:
    """The worker's coordinator client, which after :meth:`drain` answers the next request for work with stop.

    The worker asks for work only between batches, so when that request is
    answered with ``stop`` every ticket it held has been generated and
    written: none is left for the learner to reissue. Requests that take no
    work (weight polls mid-batch, checks while the buffer is full) still go
    to the learner. A draining generator whose learner does not answer gives
    up at the first timeout instead of waiting ``generator.learner_patience_s``.
    """

    def __init__(self, client, generator_id: str) -> None:
        self.client = client
        self.address = client.address
        self.generator_id = generator_id
        self.draining = False

    def drain(self, signum: int | None = None, frame=None) -> None:
        if not self.draining:
            log.warning("%s: draining: finishing the batch in hand, then stopping", self.generator_id)
        self.draining = True

    def call(self, request, expected: type):
        from asyncrl.protocol import WorkReply, WorkRequest

        if self.draining and isinstance(request, WorkRequest) and request.max_groups > 0:
            log.info("%s: drained: no tickets left in hand", self.generator_id)
            return WorkReply(tickets=[], latest=None, stop=True)
        try:
            return self.client.call(request, expected)
        except TimeoutError as exc:
            if self.draining:
                raise DrainInterrupted(f"{self.generator_id}: stopping while draining: {exc}") from None
            raise

    def close(self) -> None:
        self.client.close()


def _prometheus_port(config, i: int) -> list[str]:
    """Replica ``i`` serves /metrics on the configured generator port plus ``i``."""
    port = config.prometheus.generator_port
    return [] if port is None else [f"prometheus.generator_port={port + i}"]


def _run_replicas(args: argparse.Namespace, config, overrides: list[str], replicas: int) -> int:
    """Start ``replicas`` single generators, each with its own id, and wait for all."""
    base = args.generator_id or socket.gethostname()
    procs = [
        subprocess.Popen([sys.executable, "-m", "generators.cli", args.config,
                          "--generator-id", f"{base}-{i}", *overrides,
                          f"generator.push_rank={config.generator.push_rank + i}",
                          *_prometheus_port(config, i)])
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
