"""``asyncrl-learner CONFIG``: the learner group, and the run's control endpoint.

With ``learner.ranks > 1`` it starts itself under torchrun, one process per
rank; rank 0 also binds the buffer and the coordinator endpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from asyncrl.config import describe_keys

    # The learner reads every section: generator.samples_per_prompt sizes its steps, push its weight broadcast.
    parser = argparse.ArgumentParser(
        prog="asyncrl-learner",
        description=__doc__.splitlines()[0],
        epilog=describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("--run-dir", default=None, help="where outputs go (overrides run_dir)")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/LATEST")
    parser.add_argument(
        "--export",
        metavar="FOLDER",
        default=None,
        help="write a checkpoint of RUN_DIR as an HF folder and exit (no training)",
    )
    parser.add_argument("--tag", default=None, help="with --export: which checkpoint (default: the newest)")
    args, overrides = parser.parse_known_args(argv)

    from asyncrl.config import ConfigError, check_secrets, load_config, to_yaml

    if args.run_dir:
        overrides += ["--run_dir", args.run_dir]
    try:
        config = load_config(args.config, overrides)
        if not args.export:
            check_secrets(config, generator=False)
    except ConfigError as exc:
        print(f"asyncrl-learner: {exc}", file=sys.stderr)
        return 2
    if args.export:
        return _export(config, args.export, args.tag)
    from asyncrl.run_folder import cannot_resume, cannot_start_fresh

    if problem := cannot_resume(config.run_dir) if args.resume else cannot_start_fresh(config.run_dir):
        print(f"asyncrl-learner: {problem}", file=sys.stderr)
        return 2
    if config.learner.ranks > 1 and "MASTER_PORT" not in os.environ:
        return _torchrun(config.learner.ranks, argv if argv is not None else sys.argv[1:])
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    from asyncrl.observe import logs

    log = logs.setup(f"learner[{os.environ.get('RANK', '0')}]")
    if config.trace:
        from asyncrl.observe import trace

        trace.configure(run_dir, f"learner rank {os.environ.get('RANK', '0')}")
    import torch

    from asyncrl.control.server import CoordinatorServer
    from asyncrl.observe.metrics import plot_reward
    from learners.engine import build_engine, build_reference, init_distributed, shutdown_distributed
    from learners.trainer import Learner

    if config.learner.torch_threads:
        torch.set_num_threads(config.learner.torch_threads)
    if config.learner.weights_dir and os.environ.get("RANK", "0") == "0":
        from asyncrl.run_folder import claim

        # A folder of the user's choosing (on /dev/shm, say), which another run's config may name too: two
        # learners publishing into one folder would serve each other's weights. Held before anything is built.
        try:
            claim(Path(config.learner.weights_dir), "weights", "give each run its own learner.weights_dir", user="run")
        except ValueError as exc:
            print(f"asyncrl-learner: learner.weights_dir: {exc}", file=sys.stderr)
            return 2
    rank, world_size = init_distributed()
    torch.manual_seed(config.learner.seed + rank)
    # build_engine settles learner.pack_sequences auto in config.learner; the reference, critic and trainer read it.
    engine, model = build_engine(config.learner, config.model, config.learner.logprob_chunk_tokens)
    reference = None
    if config.algo.kl_coef > 0:
        reference = build_reference(config.learner, config.model, config.learner.logprob_chunk_tokens)
    critic = None
    if config.algo.advantage == "gae":
        from learners.critic import build_critic

        critic = build_critic(config.learner, config.model, config.algo)
    driver = server = None
    if rank == 0:
        (run_dir / "config.yaml").write_text(to_yaml(config))
        driver, rows_skipped = _driver(config, run_dir, model.config.vocab_size)
    learner = Learner(config, engine, model, rank, world_size, driver, reference, critic)
    learner.install_sigterm_handler()
    if args.resume:
        learner.resume()
    elif driver is not None:
        from asyncrl.weights import folders

        # A fresh run in an old run folder: versions published there belong to another timeline,
        # and their higher numbers would make pruning delete this run's versions as they appear.
        folders.discard_after(learner.weights_dir, -1)
    weight_server = metrics_endpoint = None
    if driver is not None and config.coordinator.weights_address:
        from asyncrl.weights.served import WeightServer

        weight_server = WeightServer(
            learner.weights_dir,
            config.coordinator.weights_address,
            config.coordinator.curve_secret_file,
            config.coordinator.weight_deltas,
        )
    if driver is not None:
        server = CoordinatorServer(
            driver.coordinator,
            config.coordinator.address,
            learner.view.status,
            config.coordinator.curve_secret_file,
            config.coordinator.long_poll_s,
        )
        driver.server = server
        if config.prometheus.learner_port is not None:
            from asyncrl.observe.prometheus import MetricsEndpoint

            metrics_endpoint = MetricsEndpoint(
                config.prometheus.host,
                config.prometheus.learner_port,
                learner.view.prometheus_metrics,
                {"run": config.name},
                config.prometheus.secret_file,
                "prometheus.learner_port",
            )
            log.info("metrics on http://%s:%d/metrics", config.prometheus.host, metrics_endpoint.port)
        log.info(
            "learner ready (%d ranks): buffer %s, control %s",
            world_size,
            config.buffer.address,
            config.coordinator.address,
        )
    summary = None
    try:
        summary = learner.run()
    except TimeoutError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if driver is not None:
            # Generators are told to stop only when the run is complete; after a
            # SIGTERM they keep waiting for a resumed learner. Weights stay served
            # meanwhile: a generator mid-fetch must finish to hear the news.
            _shutdown(driver, server, config.coordinator.timeout_s, finished=summary is not None)
        if weight_server is not None:
            weight_server.close()
        if metrics_endpoint is not None:
            metrics_endpoint.close()
        # GPU memory shared with generators and the NCCL communicators go now, while everything they need
        # is alive: left to the interpreter's teardown, a one-GPU learner could wait there forever.
        try:
            learner.publisher.close()
        finally:
            shutdown_distributed()
        log.info("learner shut down")
    if summary is None:  # not rank 0, or stopped by SIGTERM after a checkpoint
        return 0
    summary["task_rows_skipped"] = dict(rows_skipped)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_reward(run_dir, config.task.max_reward)
    log.info("done: %s", json.dumps(summary))
    return 0


def _export(config, folder: str, tag: str | None) -> int:
    """``--export``: a checkpoint of the run (``tag``, or the newest) as an HF folder."""
    from asyncrl.observe import logs
    from learners.checkpoint import export_hf

    log = logs.setup("export")
    try:
        export_hf(
            Path(config.run_dir) / "checkpoints", tag, config.model.path, Path(folder), config.model.resolved_dtype()
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:  # ValueError: not a ZeRO checkpoint
        log.error("%s", error)
        return 2
    return 0


def _driver(config, run_dir: Path, vocab_size: int):
    """Rank 0's side of the run: the task's prompts, the coordinator that tickets them (and schedules the
    held-out evaluations), the buffer reader and the metrics log; returns (driver, task rows skipped)."""
    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.staleness import StalenessBound
    from asyncrl.observe.metrics import MetricsWriter
    from asyncrl.tasks import load_items
    from buffers import open_reader
    from learners.trainer import Driver

    task = config.prompt_task()
    items, eval_items, rows_skipped = load_items(task, _tokenizer_if_needed(task, config.model.path))
    coordinator = Coordinator(
        StalenessBound(config.staleness.max_staleness, config.samples_per_version, config.staleness.on_exceed),
        PromptCursor(len(items), config.learner.seed),
        group_size=config.generator.samples_per_prompt,
        lease_s=config.coordinator.generator_lease_s,
        session=uuid.uuid4().hex[:8],
        ticket_timeout_s=config.coordinator.ticket_timeout_s,
    )
    if config.eval.every_steps and eval_items:
        from asyncrl.control.evaluation import EvalBook

        coordinator.evals = EvalBook(
            config.eval,
            len(eval_items),
            config.eval.max_new_tokens or config.generator.max_new_tokens,
            threshold=config.task.max_reward,
        )
    return Driver(open_reader(config.buffer, vocab_size), coordinator, MetricsWriter(run_dir)), rows_skipped


def _tokenizer_if_needed(task, model_path: str):
    """The learner builds prompts only to measure them (``task.max_prompt_tokens``), as generators do."""
    if not task.max_prompt_tokens:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _shutdown(driver, server, grace_s: float, finished: bool) -> None:
    """If ``finished``, tell generators to stop and give them ``grace_s`` to hear it; close everything."""
    if finished:
        driver.coordinator.stop()
        deadline = time.monotonic() + grace_s
        while driver.coordinator.generators_not_stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
    if server is not None:
        server.close()
    driver.reader.close()
    driver.metrics.close()


def _torchrun(ranks: int, argv: list[str]) -> int:
    """Re-run this command as ``ranks`` processes under torchrun on this host."""
    import subprocess

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "learners.cli",
        *argv,
    ]
    from asyncrl.tasks import child_env

    proc = subprocess.Popen(command, env=child_env())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
