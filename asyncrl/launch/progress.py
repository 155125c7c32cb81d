"""A run's supervision clock and progress bar, and the summary it writes when the learner is done."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asyncrl.config import RunConfig
from asyncrl.observe.metrics import last_metrics, read_metrics, reward_text, scored


class Progress:
    """The clock and progress bar of a run's supervision loop (``asyncrl run``, with or without Ray).

    Iterating ticks every ``every_s``, first redrawing the bar from the
    run's ``metrics.jsonl``, and raises ``TimeoutError`` once ``timeout_s``
    have passed since ``started``; leaving the ``with`` block draws the
    last step and closes the bar.
    """

    def __init__(
        self,
        config: RunConfig,
        out: Path,
        started: float,
        timeout_s: float,
        quiet: bool,
        every_s: float = 0.5,
        position: int | None = None,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        """``position``: the bar's line, where several runs show theirs at once; ``pause(every_s)`` waits between
        ticks, and may return sooner (say, once the process the loop watches has exited)."""
        self.out, self.started, self.timeout_s, self.every_s = out, started, timeout_s, every_s
        self.pause = pause
        self.bar = tqdm(
            total=config.learner.total_steps,
            desc=config.name,
            dynamic_ncols=True,
            disable=quiet or None,
            position=position,
        )

    def __iter__(self) -> Iterator[None]:
        while True:
            if time.monotonic() - self.started > self.timeout_s:
                raise TimeoutError(f"run did not finish within {self.timeout_s:.0f}s (--timeout-s)")
            update_bar(self.bar, last_metrics(self.out))
            yield
            self.pause(self.every_s)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        update_bar(self.bar, last_metrics(self.out))
        self.bar.close()


def merge_trace(config: RunConfig, out: Path) -> None:
    """With ``trace: true``, the processes' timelines merged into ``RUN_DIR/trace.json``."""
    if config.trace:
        from asyncrl.observe.trace import merge

        merge(out)


def summarize(config: RunConfig, out: Path, started: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The learner's summary.json with what only the whole run knows (and ``extra``); written back and returned."""
    summary = json.loads((out / "summary.json").read_text()) | (extra or {})
    records = read_metrics(out)
    rewarded = scored(records)
    head, tail = rewarded[: max(1, len(rewarded) // 20)], rewarded[-max(1, len(rewarded) // 20) :]
    summary.update(
        run_dir=str(out),
        total_wall_s=time.monotonic() - started,
        reward_start=sum(r["reward"] for r in head) / len(head) if head else None,  # None: every reward failed
        reward_end=sum(r["reward"] for r in tail) / len(tail) if tail else None,
        max_reward=config.task.max_reward,
        staleness_max_observed=max(r["staleness_max"] for r in records),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def update_bar(bar: tqdm, last: dict[str, Any] | None) -> None:
    if last is None:
        return
    bar.set_postfix(
        reward=reward_text(last["reward"]),
        version=last["version"],
        staleness=f"{last['staleness_mean']:.2f}",
        samples_s=f"{last['samples_per_s']:.0f}",
        refresh=False,
    )
    bar.update(last["step"] - bar.n)
