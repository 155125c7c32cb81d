"""How ``asyncrl plan`` prints: a table of options with what they assumed, or the same as JSON."""

from __future__ import annotations

import json
from typing import Any

from asyncrl.launch.plan.model import Pipeline, simulate
from asyncrl.launch.plan.rates import Measured
from asyncrl.launch.plan.search import Option


def histogram_text(staleness: dict[int, float]) -> str:
    """``0:1% 1:99%``: each staleness and its share of the samples trained on."""
    return " ".join(f"{s}:{p:.0%}" for s, p in sorted(staleness.items()) if p >= 0.005)


def options_json(options: list[Option]) -> list[dict[str, Any]]:
    return [
        {
            "learner_gpus": o.learner_gpus,
            "generator_gpus": o.generator_gpus,
            "generators": o.generators,
            "max_staleness": o.max_staleness,
            "groups_per_step": o.groups_per_step,
            "weight_transport": o.transport,
            "weight_update_s_per_version": o.update_s,
            "samples_per_s": o.prediction.achieved_samples_per_s,
            "pipeline_efficiency": o.prediction.pipeline_efficiency,
            "staleness": {str(s): p for s, p in o.prediction.staleness.items()},
            "samples_dropped_per_step": o.prediction.samples_dropped / o.prediction.steps,
            "step_s": o.prediction.wall_s / o.prediction.steps,
        }
        for o in options
    ]


def options_table(options: list[Option], assumed: dict[str, Any]) -> str:
    """The options best first, then the figures they rest on."""
    header = (
        f"{'learner':>7} {'generator':>9} {'engines':>7} {'bound':>5} {'groups':>6} {'samples/s':>10} "
        f"{'eff':>5} {'step s':>7} {'update s':>8}  staleness  weights"
    )
    lines = [header]
    for o in options:
        p = o.prediction
        lines.append(
            f"{o.learner_gpus:>7} {o.generator_gpus:>9} {o.generators:>7} {o.max_staleness:>5} "
            f"{o.groups_per_step:>6} {p.achieved_samples_per_s:>10.4g} {p.pipeline_efficiency:>5.2f} "
            f"{p.wall_s / p.steps:>7.3g} {o.update_s:>8.3g}  {histogram_text(p.staleness):<10} {o.transport}"
        )
    lines.append("assumed: " + "; ".join(f"{k}: {_plain(v)}" for k, v in assumed.items()))
    return "\n".join(lines)


def _plain(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def as_run(measured: Measured, base: Pipeline, steps: int, seed: int, as_json: bool) -> str:
    """The run as it was, simulated, beside what it measured."""
    predicted = simulate(base, steps, seed)
    rows = {
        "pipeline_efficiency": (predicted.pipeline_efficiency, measured.pipeline_efficiency),
        "achieved_samples_per_s": (predicted.achieved_samples_per_s, measured.achieved_samples_per_s),
    }
    distance = total_variation(predicted.staleness, measured.staleness)
    if as_json:
        out = {k: {"predicted": p, "measured": m} for k, (p, m) in rows.items()}
        out["staleness"] = {"predicted": predicted.staleness, "measured": measured.staleness}
        out["staleness_total_variation"] = distance
        out["assumed"] = measured.sources
        return json.dumps(out, indent=2, default=str)
    lines = [f"{measured.run_dir}: predicted beside measured ({steps} simulated steps, seed {seed})"]
    lines += [f"  {k:<24} {p:>10.4g} {m:>10.4g}  ({p / m:.2f}x)" for k, (p, m) in rows.items()]
    lines.append(
        f"  {'staleness':<24} {histogram_text(predicted.staleness):>10} {histogram_text(measured.staleness):>10}"
        f"  (total variation {distance:.3f})"
    )
    lines.append("  from: " + "; ".join(f"{k}: {v}" for k, v in measured.sources.items()))
    return "\n".join(lines)


def total_variation(a: dict[int, float], b: dict[int, float]) -> float:
    """Half the summed difference of two staleness histograms: the share of samples one would have to move."""
    return sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b)) / 2
