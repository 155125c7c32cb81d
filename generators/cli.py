"""``asyncrl-generator CONFIG``: one generator process (or ``--replicas N`` of them).

``asyncrl-generator A.yaml B.yaml ...``: one process whose vLLM engine serves several LoRA runs at once, each with
its own adapter, coordinator and buffer (:mod:`generators.pool`).

SIGTERM drains: the generator finishes and writes the groups it holds, takes
no new tickets, tells the learner it leaves, and exits 0 (``asyncrl scale``
removes generators this way, so nothing they were given waits out
``coordinator.generator_lease_s``). A second SIGTERM ends it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from asyncrl.observe.logs import ends_process

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.observe.prometheus import MetricsEndpoint
    from generators.worker import GeneratorWorker

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    """The command line: configs, then options; KEY=VALUE overrides are what it leaves."""
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
    parser.add_argument(
        "config",
        nargs="+",
        help="run config (YAML); several: LoRA runs of one base model that share this process's engine",
    )
    parser.add_argument("--generator-id", default=None, help="unique id; default host-pid")
    parser.add_argument("--replicas", type=int, default=None, help="start N generator processes")
    parser.add_argument("--produced-log", default=None, help="append the id of every rollout written to this file")
    return parser


@ends_process
def main(argv: list[str] | None = None) -> int:
    """Parse the command line and the configs, then generate until the learner is done (or drain on SIGTERM).

    As the process's own command (``argv`` unset) it ends the process once done, without the interpreter's
    teardown (:func:`asyncrl.observe.logs.ends_process`); called with ``argv``, it returns.
    """
    args, overrides = _parser().parse_known_args(argv)

    from asyncrl.config import ConfigError, check_secrets, check_shared_engine, load_config

    try:
        configs = [load_config(path, overrides) for path in args.config]
        for config in configs:
            check_secrets(config, learner=False)
        if len(configs) > 1:
            check_shared_engine(configs, args.config)
    except ConfigError as exc:
        print(f"asyncrl-generator: {exc}", file=sys.stderr)
        return 2
    replicas = args.replicas if args.replicas is not None else 1
    if replicas > 1:
        return _run_replicas(args, configs[0], overrides, replicas)
    generator_id = args.generator_id or f"{socket.gethostname()}-{os.getpid()}"
    if len(configs) > 1:
        return _run_pool(configs, generator_id, args.produced_log)
    return _run_one(configs[0], generator_id, args.produced_log)


def _run_one(config: RunConfig, generator_id: str, produced_log: str | None) -> int:
    """One generator process: open the backend, the task, the learner's coordinator and the buffer, then work."""
    from asyncrl.extras import MissingExtra
    from generators import open_backend

    _start_process(config, generator_id)
    try:
        backend = open_backend(config)
    except MissingExtra as exc:
        print(f"asyncrl-generator: {exc}", file=sys.stderr)
        return 2
    try:
        with _Worker(config, generator_id, backend, produced_log) as worker:
            drain_on_sigterm([worker])
            return worker.run()
    finally:
        backend.close()


def _run_pool(configs: list[RunConfig], generator_id: str, produced_log: str | None) -> int:
    """One process, one engine, a worker per run on a thread of its own; the worst exit code of any."""
    from generators.pool import open_pool

    _start_process(configs[0], generator_id)
    engine, lanes = open_pool(configs)
    codes: dict[str, int] = {}
    try:
        with contextlib.ExitStack() as stack:
            workers = [
                stack.enter_context(_Worker(config, generator_id, lane, produced_log))
                for config, lane in zip(configs, lanes)
            ]
            drain_on_sigterm(workers)

            def work(worker: _Worker) -> None:
                try:
                    codes[worker.config.name] = worker.run()
                except Exception:  # noqa: BLE001  (one run's failure ends that run's worker only)
                    log.exception("%s: the worker of run %s failed", generator_id, worker.config.name)
                    codes[worker.config.name] = 1

            threads = [threading.Thread(target=work, args=(w,), name=f"run-{w.config.name}") for w in workers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        for lane in lanes:
            lane.close()
        engine.close()
    log.info("%s: every run is done: %s", generator_id, codes)
    return max(codes.values(), default=0)


def _start_process(config: RunConfig, generator_id: str) -> None:
    """Logging, the trace, torch's threads and seed: once per process."""
    from asyncrl.observe import logs

    logs.setup(f"generator[{generator_id}]")
    if config.trace:
        from asyncrl.observe import trace

        trace.configure(config.run_dir, f"generator {generator_id}")
    import torch

    if config.generator.torch_threads:
        torch.set_num_threads(config.generator.torch_threads)
    torch.manual_seed(config.generator.seed + zlib.crc32(generator_id.encode()))


class _Worker:
    """One run's worker on ``backend`` with its task, coordinator client, buffer writer and metrics endpoint;
    a context manager that closes them."""

    def __init__(self, config: RunConfig, generator_id: str, backend: Any, produced_log: str | None) -> None:
        from asyncrl.control.client import CoordinatorClient
        from asyncrl.tasks import open_task
        from buffers import open_writer
        from generators.episodes import open_episodes
        from generators.worker import GeneratorWorker

        self.config, self.generator_id = config, generator_id
        task = open_task(config.prompt_task(), backend.tokenizer)
        self.client = CoordinatorClient(
            config.coordinator.address, config.coordinator.timeout_s, config.coordinator.curve_secret_file
        )
        self.writer = open_writer(config.buffer)
        self.episodes = open_episodes(config, backend)
        self.worker = GeneratorWorker(
            config,
            generator_id,
            backend,
            prompt_ids=task.prompt_ids,
            items=task.items,
            reward_fn=task.reward,
            client=self.client,
            writer=self.writer,
            eval_items=task.eval_items,
            episodes=self.episodes,
        )
        if produced_log:
            self.worker.produced_log = open(produced_log, "a")
        self.endpoint = _metrics_endpoint(config, self.worker, generator_id)
        if self.endpoint is not None:
            log.info("metrics on http://%s:%d/metrics", config.prometheus.host, self.endpoint.port)

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        self.writer.close()
        self.client.close()
        if self.episodes is not None:
            self.episodes.close()

    def drain(self) -> None:
        self.worker.drain()

    def run(self) -> int:
        """Work until the learner says stop or the worker is drained; 1 if the coordinator stopped answering."""
        from asyncrl.weights.served import OtherLearner
        from asyncrl.wire.peers import HandshakeRefused

        try:
            self.worker.run()
        except (OtherLearner, HandshakeRefused) as exc:  # two runs' addresses or keys mixed up: waiting won't mend
            log.error("%s: %s", self.config.name, exc)
            return 1
        except TimeoutError as exc:
            if not self.worker.draining:
                log.error("%s: %s", self.config.name, exc)
                return 1
            log.warning("%s: stopping while draining: %s", self.generator_id, exc)
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


def drain_on_sigterm(workers: Sequence[GeneratorWorker | _Worker]) -> None:
    """The first SIGTERM drains every worker of ``workers``; a second one ends the process at once.

    The handler only sets the worker's flag and restores the default action:
    logging from a signal handler can re-enter a stream the main thread is
    writing to. The worker logs when it acts on the flag.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for worker in workers:
            worker.drain()

    signal.signal(signal.SIGTERM, handler)


def _run_replicas(args: argparse.Namespace, config, overrides: list[str], replicas: int) -> int:
    """Start ``replicas`` single generators, each with its own id, and wait for all; SIGTERM reaches each (they
    drain). The exit status is the first failure's, 128 + N for a replica killed by signal N (the out-of-memory
    killer's 9, say), 0 when all ended well."""
    from asyncrl.tasks import child_env

    base = args.generator_id or socket.gethostname()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "generators.cli",
                *args.config,
                "--generator-id",
                f"{base}-{i}",
                *overrides,
                *config.replica_overrides(i),
            ],
            env=child_env(),
        )
        for i in range(replicas)
    ]
    signal.signal(signal.SIGTERM, lambda signum, frame: [p.send_signal(signal.SIGTERM) for p in procs])
    try:
        codes = [p.wait() for p in procs]
        return next((code if code > 0 else 128 - code for code in codes if code), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()


if __name__ == "__main__":
    sys.exit(main())
