"""What a finished run measured, read from its folder: the rates, lengths and timings a plan starts from.

``summary.json`` gives the generators' and the learner's capacities as the run
counted them (samples per busy second) and what it achieved; ``config.yaml``
the run's shape; ``metrics.jsonl`` each step's time, tokens and records
overhead; ``consumed.jsonl`` (or, where the run did not keep it, each step's
staleness in ``metrics.jsonl``) the staleness histogram; the generators' logs
how long a version took to load. Anything missing is named by file and field.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from asyncrl.launch.plan.model import Lengths, Pipeline

_LOADED = re.compile(r"loaded weights v\d+ in ([0-9.]+)s")
_BUCKET = re.compile(r"^(\d+)-(\d+)$|^>(\d+)$")


class RunFolderError(ValueError):
    """A run folder that lacks what a plan needs: one line naming the file and the field."""


@dataclass(frozen=True)
class Measured:
    """One run's measurements: the :class:`Pipeline` it was, and what it achieved, for comparison."""

    run_dir: Path
    pipeline: Pipeline
    achieved_samples_per_s: float
    pipeline_efficiency: float
    staleness: dict[int, float]  # staleness -> share of the samples trained on
    shared_device: bool  # generators and learner time-sliced one device
    gpus_per_generator: int  # a generator engine's devices (vLLM's tensor_parallel_size)
    learner_gpus: int  # the learner's ranks
    sources: dict[str, str]  # where each input came from, for the report


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise RunFolderError(f"{path}: missing (a run writes it when it ends)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunFolderError(f"{path}: not JSON ({exc})") from None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise RunFolderError(f"{path}: missing")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise RunFolderError(f"{path}: a line is not JSON ({exc})") from None


def field(record: dict[str, Any], path: Path, *keys: str) -> Any:
    """``record[k1][k2]...``, or a one-line error naming the file and the dotted field."""
    value: Any = record
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or value.get(key) is None:
            raise RunFolderError(f"{path}: no field {'.'.join(keys[: depth + 1])!r}")
        value = value[key]
    return value


def _positive(record: dict[str, Any], path: Path, key: str) -> float:
    value = field(record, path, key)
    if not isinstance(value, (int, float)) or value <= 0:
        raise RunFolderError(f"{path}: field {key!r} is {value!r}; expected a number above 0")
    return float(value)


def _lengths(summary: dict, config: dict, steps: list[dict], folder: Path) -> tuple[Lengths, str]:
    """The response lengths: ``staleness_by_length``'s buckets, else a lognormal of the steps' mean length."""
    counts: Counter[int] = Counter()
    for label, row in (summary.get("staleness_by_length") or {}).items():
        match = _BUCKET.match(label)
        if match:
            low, high, above = match.groups()
            length = (int(low) + int(high)) // 2 if low else int(above) + 1
            counts[length] += sum(v for k, v in row.items() if k != "stale_rate")
    if counts:
        return Lengths.histogram(counts), "summary.json staleness_by_length"
    mean = statistics.fmean(float(field(s, folder / "metrics.jsonl", "response_len")) for s in steps)
    most = int(field(config, folder / "config.yaml", "generator", "max_new_tokens"))
    return Lengths.lognormal(mean, most).with_mean(
        mean
    ), f"lognormal, mean {mean:.1f} (metrics.jsonl), max {most} (config.yaml)"


def _staleness(folder: Path, steps: list[dict]) -> tuple[dict[int, float], str]:
    """Each trained sample's staleness from ``consumed.jsonl``, else from each step's mean and max."""
    counts: Counter[int] = Counter()
    path = folder / "consumed.jsonl"
    if path.exists():
        for line in _jsonl(path):
            counts[int(field(line, path, "staleness"))] += 1
        source = "consumed.jsonl"
    else:
        # A step whose mean lies between two whole numbers is taken to hold only those two (exact when its max
        # is the upper one); the runs here show one or two values per step.
        for s in steps:
            n, mean = (
                field(s, folder / "metrics.jsonl", "samples"),
                field(s, folder / "metrics.jsonl", "staleness_mean"),
            )
            low = int(mean)
            upper = round(n * (mean - low))
            counts[low] += n - upper
            counts[low + 1] += upper
        source = "metrics.jsonl staleness_mean per step"
    total = sum(counts.values())
    if not total:
        raise RunFolderError(f"{path}: no trained samples")
    return {s: n / total for s, n in sorted(counts.items()) if n}, source


def _step_timing(steps: list[dict], path: Path) -> tuple[float, float, tuple[float, ...]]:
    """The learner's records overhead per step (wall time outside step, publish and wait; median), the share
    of its busy time that does not grow with response tokens, and the spread of its steps about that fit,
    the first step left out as warm-up.

    Busy time is fitted as ``a + b * tokens`` over the steps; ``a`` over the mean busy time is the fixed
    share. Where the tokens hardly moved (under 5% spread) nothing can be fitted and the share is 0.
    """
    overheads, busy, tokens = [], [], []
    previous = 0.0
    for s in steps:
        busy.append(field(s, path, "step_s") + s.get("publish_s", 0.0))
        overheads.append(field(s, path, "wall_s") - previous - busy[-1] - field(s, path, "wait_s"))
        previous = s["wall_s"]
        tokens.append(max(float(field(s, path, "tokens")), 1.0))
    t, b = np.array(tokens[1:] or tokens), np.array(busy[1:] or busy)
    fixed = 0.0
    if len(t) > 2 and t.std() > 0.05 * t.mean():
        slope, intercept = np.polyfit(t, b, 1)
        fixed = float(np.clip(intercept / b.mean(), 0.0, 1.0)) if slope > 0 else 1.0
    expected = fixed + (1 - fixed) * t / t.mean()  # each step's busy time over the mean, as the fit has it
    spread = b / b.mean() / expected
    overhead = max(0.0, statistics.median(overheads[1:] or overheads))
    return overhead, fixed, tuple(float(x) for x in spread / spread.mean())


def length_scale(steps: list[dict], path: Path, phases: int = 20) -> tuple[float, ...]:
    """The mean response length of each of ``phases`` equal stretches of the run, over the run's mean.

    A run that learns changes its answers' length (the SmolLM2 arithmetic run's
    shrank fivefold), and its generators and learner change speed with them.
    """
    lengths = [float(field(s, path, "response_len")) for s in steps]
    mean = statistics.fmean(lengths)
    if len(lengths) < 2 or mean <= 0:
        return ()
    cuts = np.array_split(np.array(lengths), min(phases, len(lengths)))
    return tuple(float(part.mean() / mean) for part in cuts)


def _reload_s(folder: Path) -> tuple[float, str]:
    """The median seconds a generator took to load a version, from its logs; 0 where none were kept."""
    loads = [float(m) for log in sorted(folder.glob("logs/generator-*.log")) for m in _LOADED.findall(log.read_text())]
    if not loads:
        return 0.0, "no generator logs: 0"
    return statistics.median(loads), f"median of {len(loads)} loads in logs/generator-*.log"


def _evaluations(config: dict, summary: dict) -> dict[str, Any]:
    """How often the run evaluated, on how many held-out prompts, with how many samples each, in what pieces."""
    ev = config.get("eval") or {}
    every = int(ev.get("every_steps") or 0)
    task = config.get("task") or {}
    if not every or not (task.get("eval_dataset") or task.get("eval_fraction")):
        return {}
    return {
        "eval_every_steps": every,
        "eval_prompts": int((summary.get("eval") or {}).get("prompts") or ev.get("max_items") or 0),
        "eval_k": int(ev.get("k") or 0),
        "eval_prompts_per_piece": int(ev.get("items_per_request") or 0),
        "eval_max_share": float(ev.get("max_share") or 0.0),
    }


def _evaluation_source(pipeline: Pipeline) -> str:
    if not pipeline.eval_every_steps:
        return "none"
    source = "config.yaml eval: pieces of eval.items_per_request prompts"
    share = pipeline.eval_max_share
    return source + (f", at most eval.max_share {share:g} of what is generated" if share else "")


def read_run(run_dir: str | Path, streaming: bool | None = None) -> Measured:
    """What the run in ``run_dir`` measured; ``streaming`` overrides how its generator is taken to sample.

    Unless told, a vLLM generator with updates in flight is taken to stream
    and any other to sample a request's groups together.
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: not a run folder")
    summary = _json(folder / "summary.json")
    config_path = folder / "config.yaml"
    if not config_path.exists():
        raise RunFolderError(f"{config_path}: missing (a run writes it as it starts)")
    config = yaml.safe_load(config_path.read_text()) or {}
    steps = _jsonl(folder / "metrics.jsonl")
    if not steps:
        raise RunFolderError(f"{folder / 'metrics.jsonl'}: no steps")
    gen = field(config, config_path, "generator")
    generators = int(gen.get("replicas") or 1)
    lengths, length_source = _lengths(summary, config, steps, folder)
    overhead_s, fixed_share, jitter = _step_timing(steps, folder / "metrics.jsonl")
    reload_s, reload_source = _reload_s(folder)
    staleness, staleness_source = _staleness(folder, steps)
    if streaming is None:
        streaming = gen.get("backend") == "vllm" and bool(gen.get("update_in_flight", True))
    summary_path = folder / "summary.json"
    pipeline = Pipeline(
        generators=generators,
        generator_samples_per_s=_positive(summary, summary_path, "generator_capacity_samples_per_s") / generators,
        learner_samples_per_s=_positive(summary, summary_path, "learner_capacity_samples_per_s"),
        max_staleness=int(field(summary, summary_path, "max_staleness")),
        group_size=int(field(gen, config_path, "samples_per_prompt")),
        groups_per_step=int(field(config, config_path, "learner", "groups_per_step")),
        groups_per_request=int(field(gen, config_path, "groups_per_request")),
        lengths=lengths,
        streaming=streaming,
        groups_in_flight=int(gen.get("max_groups_in_flight") or 0),
        learner_overhead_s=overhead_s,
        reload_s=reload_s,
        jitter=jitter,
        length_scale=length_scale(steps, folder / "metrics.jsonl"),
        learner_fixed_share=fixed_share,
        publish_every_steps=int(config.get("learner", {}).get("publish_every_steps") or 1),
        **_evaluations(config, summary),
    )
    devices = (str(gen.get("devices")), str(config.get("learner", {}).get("devices")))
    return Measured(
        run_dir=folder,
        pipeline=pipeline,
        achieved_samples_per_s=_positive(summary, summary_path, "achieved_samples_per_s"),
        pipeline_efficiency=_positive(summary, summary_path, "pipeline_efficiency"),
        staleness=staleness,
        shared_device=devices[0] == devices[1] and devices[0] not in ("None", ""),
        gpus_per_generator=int((gen.get("vllm") or {}).get("tensor_parallel_size") or 1)
        if gen.get("backend") == "vllm"
        else 1,
        learner_gpus=int(config.get("learner", {}).get("ranks") or 1),
        sources={
            "rates": f"summary.json over {generators} generator(s) (config.yaml generator.replicas), per GPU over "
            "generator.vllm.tensor_parallel_size and learner.ranks",
            "lengths": length_source,
            "length phases": "metrics.jsonl response_len, in 20 stretches of the run",
            "step time spread, its fixed share and records overhead": "metrics.jsonl (step time fitted on tokens)",
            "evaluations": _evaluation_source(pipeline),
            "version load": reload_source,
            "staleness": staleness_source,
        },
    )


def with_changes(measured: Measured, **changes: Any) -> Pipeline:
    """The measured pipeline with some of its fields changed (say, more generators)."""
    return replace(measured.pipeline, **changes)
