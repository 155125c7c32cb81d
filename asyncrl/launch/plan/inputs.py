"""What ``asyncrl plan`` starts from: a run folder's measurements, the command line's figures over them.

Every figure the plan assumed rather than read is listed in ``assumed``, so
the table says what it rests on.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from asyncrl.launch.plan.model import Lengths, Pipeline
from asyncrl.launch.plan.rates import Measured, read_run
from asyncrl.launch.plan.search import Cluster, Rates

# Without a run folder: the shape of a run at asyncrl's defaults (generator.samples_per_prompt and
# groups_per_request, learner.groups_per_step) on GPUs, where vLLM streams.
DEFAULT_GROUP_SIZE = 8
DEFAULT_GROUPS_PER_STEP = 16


def _lengths(args: argparse.Namespace, measured: Measured | None) -> Lengths:
    if args.mean_tokens is None and args.max_tokens is None:
        if measured is None:
            raise ValueError("give --mean-tokens and --max-tokens (the response lengths), or --from RUN_DIR")
        return measured.pipeline.lengths
    if args.mean_tokens is None or args.max_tokens is None:
        raise ValueError("--mean-tokens and --max-tokens go together")
    return Lengths.lognormal(args.mean_tokens, args.max_tokens)


def _rates(args: argparse.Namespace, measured: Measured | None) -> Rates:
    """Per-GPU rates: the command line's, else the run's per generator GPU and per learner rank."""
    generator, learner = args.generator_rate, args.learner_rate
    if measured is not None:
        pipe = measured.pipeline
        generator = generator or pipe.generator_samples_per_s / measured.gpus_per_generator
        learner = learner or pipe.learner_samples_per_s / measured.learner_gpus
    if not generator or not learner or generator <= 0 or learner <= 0:
        raise ValueError("give --generator-rate and --learner-rate (samples/s per GPU, above 0), or --from RUN_DIR")
    shared = measured is not None and measured.shared_device and args.generator_rate is None
    return Rates(generator, learner, shared=shared)


def _base(args: argparse.Namespace, measured: Measured | None, lengths: Lengths) -> Pipeline:
    """The run's shape, overheads and spread where there is a run, asyncrl's defaults where there is not."""
    if measured is not None:
        base = measured.pipeline
        if lengths != base.lengths:  # the run's length phases and prompt costs belong to its own lengths
            base = replace(base, lengths=lengths, length_scale=(), learner_fixed_share=0.0)
    else:
        base = Pipeline(
            generators=1,
            generator_samples_per_s=1.0,
            learner_samples_per_s=1.0,
            max_staleness=1,
            group_size=DEFAULT_GROUP_SIZE,
            groups_per_step=DEFAULT_GROUPS_PER_STEP,
            groups_per_request=DEFAULT_GROUPS_PER_STEP,
            lengths=lengths,
            streaming=True,
        )
    if args.group_size:
        base = replace(base, group_size=args.group_size)
    if args.engine:
        base = replace(base, streaming=args.engine == "streaming")
    return base


def _phases(base: Pipeline) -> str:
    if not base.length_scale:
        return "one"
    return " ".join(f"{scale:.2g}" for scale in base.length_scale)


def inputs(args: argparse.Namespace) -> tuple[Pipeline, Rates, Cluster | None, Measured | None, dict[str, Any]]:
    """The base pipeline, per-GPU rates, the cluster (None: the run as it was) and what was assumed."""
    streaming = None if args.engine is None else args.engine == "streaming"
    measured = read_run(args.run_dir, streaming) if args.run_dir else None
    lengths = _lengths(args, measured)
    rates = _rates(args, measured)
    base = _base(args, measured, lengths)
    assumed: dict[str, Any] = dict(measured.sources) if measured else {}
    assumed.update(
        {
            "generator samples/s per GPU": rates.generator_samples_per_s,
            "learner samples/s per GPU": rates.learner_samples_per_s,
            "mean response tokens": round(lengths.mean(), 1),
            "length phases (mean over the run's)": _phases(base),
            "learner time not growing with response tokens": f"{base.learner_fixed_share:.0%}",
            "engine": "streaming" if base.streaming else "batch",
            "learner rate grows with its GPUs": "in proportion (ZeRO-3 data parallel, batch per GPU fixed)",
        }
    )
    if args.gpus is None:
        if measured is None:
            raise ValueError("give --gpus (the GPUs to split), or --from RUN_DIR to predict the run as it was")
        return base, rates, None, measured, assumed
    if args.gpus < 1 or args.hosts < 1 or args.gpus % args.hosts:
        raise ValueError(f"--gpus {args.gpus} over --hosts {args.hosts}: expected whole GPUs per host")
    cluster = Cluster(
        gpus=args.gpus,
        hosts=args.hosts,
        link_gbps=args.link_gbps,
        host_link_gbps=args.host_link_gbps,
        gpus_per_generator=args.gpus_per_generator,
        version_bytes=args.weights_gb * 1e9,
    )
    assumed.update(
        {
            "version size (GB)": args.weights_gb,
            "link between hosts (Gbit/s)": args.link_gbps,
            "link within a host (Gbit/s)": args.host_link_gbps,
        }
    )
    return base, rates, cluster, measured, assumed
