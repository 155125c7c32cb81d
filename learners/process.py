"""One learner process: build this rank's models and, on rank 0, the driver and its endpoints; train; shut down.

:mod:`learners.cli` parses the command line and imports this only then, so
``asyncrl-learner --help`` answers without torch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.config import RunConfig, to_yaml
from asyncrl.control.server import CoordinatorServer
from asyncrl.observe import logs, trace
from asyncrl.observe.metrics import plot_reward
from learners import checkpoint
from learners.engine import AdapterOff, build_engine, build_reference, init_distributed, shutdown_distributed
from learners.trainer import Driver, Learner

if TYPE_CHECKING:
    from asyncrl.observe.prometheus import MetricsEndpoint
    from asyncrl.weights.served import WeightServer


def train(config: RunConfig, resume: bool) -> int:
    """Run this rank of the learner group until the run ends (or SIGTERM); returns the exit status."""
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = logs.setup(f"learner[{os.environ.get('RANK', '0')}]")
    if config.trace:
        trace.configure(run_dir, f"learner rank {os.environ.get('RANK', '0')}")
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
    if resume and config.learner.zero_stage is None and checkpoint.written_without_zero(run_dir / "checkpoints"):
        # Written before one bf16 rank took stage 1 by default: DeepSpeed loads a checkpoint only into the
        # optimizer that wrote it.
        log.info("--resume: the checkpoint was written without ZeRO; learner.zero_stage 0 for this run")
        config.learner.zero_stage = 0
    engine, model, reference, critic = _models(config)
    driver = None
    if rank == 0:
        (run_dir / "config.yaml").write_text(to_yaml(config))
        driver, rows_skipped = _driver(config, run_dir, model.config.vocab_size)
    learner = Learner(config, engine, model, rank, world_size, driver, reference, critic)
    learner.install_sigterm_handler()
    if resume:
        learner.resume()
    elif driver is not None:
        from asyncrl.weights import folders

        # A fresh run in an old run folder: versions published there belong to another timeline,
        # and their higher numbers would make pruning delete this run's versions as they appear.
        folders.discard_after(learner.weights_dir, -1)
    endpoints = _serve(config, learner, driver, world_size, log) if driver is not None else Endpoints()
    summary = None
    try:
        summary = learner.run()
    except TimeoutError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _close(config, learner, driver, endpoints, finished=summary is not None)
        log.info("learner shut down")
    if summary is None:  # not rank 0, or stopped by SIGTERM after a checkpoint
        return 0
    summary["task_rows_skipped"] = dict(rows_skipped)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_reward(run_dir, config.task.max_reward)
    log.info("done: %s", json.dumps(summary))
    return 0


def _models(config: RunConfig):
    """This rank's policy engine and HF model, and the reference and critic engines the algorithm needs.

    ``build_engine`` settles ``learner.pack_sequences: auto`` in ``config.learner`` first; the reference, the
    critic and the learner read it after.
    """
    engine, model = build_engine(config.learner, config.model, config.learner.logprob_chunk_tokens)
    reference = critic = None
    if config.algo.kl_coef > 0 and config.learner.lora.enabled:
        reference = AdapterOff(engine, model)  # the base itself, its adapter off: no second copy
    elif config.algo.kl_coef > 0:
        reference = build_reference(config.learner, config.model, config.learner.logprob_chunk_tokens)
    if config.algo.advantage == "gae":
        from learners.critic import build_critic

        critic = build_critic(config.learner, config.model, config.algo)
    return engine, model, reference, critic


def _driver(config: RunConfig, run_dir: Path, vocab_size: int) -> tuple[Driver, dict]:
    """Rank 0's side of the run: the task's prompts, the coordinator that tickets them (and schedules the
    held-out evaluations), the buffer reader and the metrics log; returns (driver, task rows skipped)."""
    from asyncrl.control.coordinator import Coordinator, PromptCursor
    from asyncrl.control.staleness import StalenessBound
    from asyncrl.observe.metrics import MetricsWriter
    from asyncrl.tasks import load_items
    from buffers import open_reader

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


@dataclass
class Endpoints:
    """What rank 0 serves while it trains: the coordinator, and where configured the weights and /metrics."""

    coordinator: CoordinatorServer | None = None
    weights: WeightServer | None = None
    metrics: MetricsEndpoint | None = None


def _serve(config: RunConfig, learner: Learner, driver: Driver, world_size: int, log: logging.Logger) -> Endpoints:
    """Rank 0: start serving weights (with ``coordinator.weights_address``), the coordinator and /metrics."""
    endpoints = Endpoints()
    if config.coordinator.weights_address:
        from asyncrl.weights.served import WeightServer

        endpoints.weights = WeightServer(
            learner.weights_dir,
            config.coordinator.weights_address,
            config.coordinator.curve_secret_file,
            config.coordinator.weight_deltas,
            session=driver.coordinator.session,
        )
    endpoints.coordinator = driver.server = CoordinatorServer(
        driver.coordinator,
        config.coordinator.address,
        learner.view.status,
        config.coordinator.curve_secret_file,
        config.coordinator.long_poll_s,
        config.coordinator.run_id,
    )
    if config.prometheus.learner_port is not None:
        from asyncrl.observe.prometheus import MetricsEndpoint

        endpoints.metrics = MetricsEndpoint(
            config.prometheus.host,
            config.prometheus.learner_port,
            learner.view.prometheus_metrics,
            {"run": config.name},
            config.prometheus.secret_file,
            "prometheus.learner_port",
        )
        log.info("metrics on http://%s:%d/metrics", config.prometheus.host, endpoints.metrics.port)
    log.info(
        "learner ready (%d ranks): buffer %s, control %s", world_size, config.buffer.address, config.coordinator.address
    )
    return endpoints


def _close(config: RunConfig, learner: Learner, driver: Driver | None, endpoints: Endpoints, finished: bool) -> None:
    """Shut the process down in order: generators told (if ``finished``), endpoints, weights, the group."""
    if driver is not None:
        # Generators are told to stop only when the run is complete; after a
        # SIGTERM they keep waiting for a resumed learner. Weights stay served
        # meanwhile: a generator mid-fetch must finish to hear the news.
        _shutdown(driver, endpoints.coordinator, config.coordinator.timeout_s, finished)
    if endpoints.weights is not None:
        endpoints.weights.close()
    if endpoints.metrics is not None:
        endpoints.metrics.close()
    # GPU memory shared with generators and the NCCL communicators go now, while everything they need
    # is alive: left to the interpreter's teardown, a one-GPU learner could wait there forever.
    try:
        learner.publisher.close()
    finally:
        shutdown_distributed()


def _shutdown(driver: Driver, server: CoordinatorServer | None, grace_s: float, finished: bool) -> None:
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
