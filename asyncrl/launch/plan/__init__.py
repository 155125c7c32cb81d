"""``asyncrl plan``: how to split a cluster between generators and learner, from measured rates (:mod:`.model`).

    asyncrl plan --from runs/quickstart                       # the run as it was: predicted beside measured
    asyncrl plan --from runs/quickstart --gpus 8              # the best splits of 8 GPUs at its rates
    asyncrl plan --generator-rate 40 --learner-rate 12 --gpus 64 --hosts 8 --weights-gb 15.2 \\
        --mean-tokens 4000 --max-tokens 16384 --gpus-per-generator 2 --json

Rates are samples per busy second per GPU, as ``summary.json`` counts them
(:mod:`.rates` reads them, the length distribution and the step timings from
a run folder); each split is played by a discrete-event simulation of the
pipeline (:mod:`.search`), so the staleness bound's admission, the step
times and the weight updates all count.
"""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="size a run: generator and learner GPUs, max_staleness and groups per step, by simulating the pipeline",
    )
    plan.add_argument("--from", dest="run_dir", default=None, help="a finished run's folder: its rates and lengths")
    plan.add_argument("--gpus", type=int, default=None, help="GPUs to split (unset with --from: the run as it was)")
    plan.add_argument("--hosts", type=int, default=1, help="machines the GPUs are spread over")
    plan.add_argument("--link-gbps", type=float, default=100.0, help="bandwidth between hosts, Gbit/s")
    plan.add_argument("--host-link-gbps", type=float, default=1200.0, help="between GPUs of a host, Gbit/s")
    plan.add_argument("--gpus-per-generator", type=int, default=1, help="GPUs of one engine (tensor parallel)")
    plan.add_argument("--weights-gb", type=float, default=0.0, help="one version's size (bf16: 2 GB per 1B params)")
    plan.add_argument("--generator-rate", type=float, default=None, help="one GPU's generated samples/s")
    plan.add_argument("--learner-rate", type=float, default=None, help="one GPU's trained samples/s")
    plan.add_argument("--mean-tokens", type=float, default=None, help="mean response length (lognormal)")
    plan.add_argument("--max-tokens", type=int, default=None, help="longest response (generator.max_new_tokens)")
    plan.add_argument("--group-size", type=int, default=None, help="generator.samples_per_prompt (default 8)")
    plan.add_argument(
        "--groups-per-step",
        type=int,
        nargs="+",
        default=None,
        help="learner.groups_per_step to try (default: powers of two whose admission window covers the engines)",
    )
    plan.add_argument("--max-staleness", type=int, nargs="+", default=None, help="bounds to try (default 0-4)")
    plan.add_argument("--engine", choices=["batch", "streaming"], default=None, help="how a generator samples")
    plan.add_argument("--steps", type=int, default=200, help="learner steps each simulation plays")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--top", type=int, default=5, help="options to show")
    plan.add_argument("--json", action="store_true", help="print the options as JSON")


def command(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.launch.plan.inputs import inputs
    from asyncrl.launch.plan.report import as_run, options_json, options_table
    from asyncrl.launch.plan.search import search

    if overrides:
        raise ValueError(f"asyncrl plan takes no overrides: {' '.join(overrides)}")
    base, rates, cluster, measured, assumed = inputs(args)
    if cluster is None:
        print(as_run(measured, base, args.steps, args.seed, args.json))
        return 0
    staleness = args.max_staleness or [0, 1, 2, 3, 4]
    options = search(base, cluster, rates, staleness, args.groups_per_step, args.steps, args.seed)[: args.top]
    if args.json:
        print(json.dumps({"assumed": assumed, "options": options_json(options)}, indent=2))
    else:
        print(options_table(options, assumed))
    return 0
