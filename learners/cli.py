"""``asyncrl-learner CONFIG``: the learner process, and the run's control endpoint."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl-learner", description=__doc__)
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("--run-dir", default=None, help="where outputs go (overrides run_dir)")
    args, overrides = parser.parse_known_args(argv)

    from asyncrl.config import load_config, to_yaml

    if args.run_dir:
        overrides += ["--run_dir", args.run_dir]
    config = load_config(args.config, overrides)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))

    from asyncrl import logs

    log = logs.setup("learner")
    import torch

    from asyncrl.coordinator import Coordinator, CoordinatorServer, PromptCursor
    from asyncrl.metrics import MetricsWriter, plot_reward
    from asyncrl.staleness import StalenessBound
    from asyncrl.tasks import load_prompts
    from buffers import open_reader
    from learners.engine import build_engine, init_distributed
    from learners.trainer import Learner

    torch.set_num_threads(config.learner.torch_threads)
    torch.manual_seed(config.learner.seed)
    rank, world_size = init_distributed()
    if world_size != 1:
        log.error("this learner runs as a single rank; multi-rank groups are not supported yet")
        return 2
    engine, model = build_engine(config.learner, config.model, config.learner.logprob_chunk_tokens)
    num_prompts = len(load_prompts(config.task.prompts, config.task.prompt_args))
    bound = StalenessBound(config.staleness.max_staleness, config.samples_per_version)
    coordinator = Coordinator(
        bound,
        PromptCursor(num_prompts, config.learner.seed),
        group_size=config.generator.samples_per_prompt,
        lease_s=config.coordinator.generator_lease_s,
        session=uuid.uuid4().hex[:8],
    )
    reader = open_reader(config.buffer)
    metrics = MetricsWriter(run_dir)
    learner = Learner(config, engine, model, reader, coordinator, metrics)
    server = CoordinatorServer(coordinator, config.coordinator.address, learner.status,
                               config.coordinator.curve_secret_file)
    log.info("learner ready: buffer %s, control %s", config.buffer.address, config.coordinator.address)
    try:
        summary = learner.run()
    except TimeoutError as exc:
        log.error("%s", exc)
        return 1
    finally:
        coordinator.stop()
        # Let generators hear "stop" on their next request before the endpoint goes away.
        deadline = time.monotonic() + config.coordinator.timeout_s
        while coordinator.generators_not_stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.close()
        reader.close()
        metrics.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_reward(run_dir, config.task.max_reward)
    log.info("done: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
