"""A bounded sample of the rollouts trained on, every token kept: what ``asyncrl view`` and a notebook read.

Each step, ``learner.rollout_samples_per_step`` of its rollouts, spread evenly
over the batch (so over its groups), go to ``RUN_DIR/rollouts.jsonl``, one
line each: the step, the version trained, the rollout's ids and prompt, its
reward and staleness, and per response token the id, the behaviour log-prob,
the learner's log-prob at the step (before its update; rank 0's rollouts), the
version that sampled it, the loss mask and the advantage the step used.
As many of the rollouts dropped since the step before (stale, uniform reward,
orphaned...), drawn uniformly from all of them (:class:`DropSample`), are
kept beside them, each with its ``drop_reason``. Writing stops once the file
reaches ``learner.rollout_sample_max_mb``; the file is JSONL, which
``datasets.load_dataset("json", ...)`` reads as it is.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import IO

import torch

from asyncrl.wire.protocol import Rollout

log = logging.getLogger(__name__)
FILE = "rollouts.jsonl"


class DropSample:
    """A uniform sample of at most ``size`` of the rollouts dropped since the last :meth:`take` (reservoir
    sampling: whatever the number of drops, the memory held is ``size`` rollouts; ``size`` 0 keeps none)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self._kept: list[tuple[Rollout, str]] = []
        self._seen = 0
        self._random = random.Random(seed)

    def add(self, rollout: Rollout, reason: str) -> None:
        if self.size <= 0:
            return
        self._seen += 1
        if len(self._kept) < self.size:
            self._kept.append((rollout, reason))
        elif (slot := self._random.randrange(self._seen)) < self.size:
            self._kept[slot] = (rollout, reason)

    def take(self) -> list[tuple[Rollout, str]]:
        """The sample, in the order the drops came; the next one starts empty."""
        kept, self._kept, self._seen = self._kept, [], 0
        return kept


def spread(count: int, of: int) -> list[int]:
    """``count`` indices spread evenly over ``range(of)`` (all of them when ``count >= of``)."""
    if count >= of:
        return list(range(of))
    return [i * of // count for i in range(count)]


def _rounded(values, digits: int = 4) -> list[float | None]:
    """Rounded for the file; a value that is not finite (a diverged learner's log-prob) as null, which JSON
    readers (the viewer's, ``datasets``) take, where ``NaN`` is not JSON."""
    return [round(x, digits) if math.isfinite(x := float(v)) else None for v in values]


class RolloutSampler:
    """Appends each step's sample to ``run_dir/rollouts.jsonl`` until the file holds ``max_mb``."""

    def __init__(self, run_dir: Path, per_step: int, max_mb: float) -> None:
        self.path = Path(run_dir) / FILE
        self.per_step, self.max_bytes = per_step, int(max_mb * 1e6)
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._full = False
        self._out: IO[str] | None = None  # opened at the first write

    def pick(self, batch: list[Rollout]) -> set[str]:
        """The ids of the rollouts of ``batch`` this step keeps (so the step can keep their learner log-probs)."""
        if self.per_step <= 0 or self._full:
            return set()
        return {batch[i].rollout_id for i in spread(self.per_step, len(batch))}

    def write(
        self,
        step: int,
        version: int,
        batch: list[Rollout],
        staleness: list[int],
        advantages: list | None,
        learner_logprobs: dict[str, list[float]] | None = None,
    ) -> None:
        """``batch``'s sample for ``step``; ``advantages`` (per token, aligned with ``batch``) where known, and the
        learner's log-probs of the kept rollouts (by id) where it measured them."""
        if self.per_step <= 0 or self._full or not batch:
            return
        lines = []
        for i in spread(self.per_step, len(batch)):
            rollout = batch[i]
            advantage = advantages[i] if advantages is not None else None
            if isinstance(advantage, torch.Tensor):
                advantage = advantage.detach().float().flatten().tolist()
            kept = record(step, version, rollout, staleness[i], advantage)
            learner = (learner_logprobs or {}).get(rollout.rollout_id)
            kept["learner_logprobs"] = None if learner is None else _rounded(learner)
            lines.append(json.dumps(kept) + "\n")
        self._append("".join(lines))

    def write_dropped(self, step: int, version: int, dropped: list[tuple[Rollout, str]]) -> None:
        """A sample of the rollouts dropped since the last step, each with its reason (``drop_reason``) and its
        staleness against ``version``; nothing trained on them, so they carry no advantages."""
        if self.per_step <= 0 or self._full or not dropped:
            return
        lines = []
        for i in spread(self.per_step, len(dropped)):
            rollout, reason = dropped[i]
            kept = record(step, version, rollout, version - rollout.oldest_version, None)
            kept["drop_reason"], kept["learner_logprobs"] = reason, None
            lines.append(json.dumps(kept) + "\n")
        self._append("".join(lines))

    def _append(self, text: str) -> None:
        if self._size + len(text) > self.max_bytes:
            self._full = True
            log.warning(
                "%s holds %.0f MB: no more rollouts are kept (learner.rollout_sample_max_mb)",
                self.path,
                self._size / 1e6,
            )
            return
        if self._out is None:
            self._out = self.path.open("a", buffering=1)
        self._out.write(text)
        self._size += len(text)


def record(step: int, version: int, rollout: Rollout, staleness: int, advantages: list[float] | None) -> dict:
    """One rollout as ``rollouts.jsonl`` keeps it."""
    tokens = len(rollout.response_ids)
    mask = list(rollout.loss_mask) or [1] * tokens
    if advantages is not None and len(advantages) != tokens:  # a scalar per rollout, or per trained token
        advantages = (advantages * tokens)[:tokens] if len(advantages) == 1 else None
    return {
        "step": step,
        "version": version,
        "id": rollout.rollout_id,
        "group": rollout.group_id,
        "prompt_index": rollout.prompt_index,
        "generator": rollout.generator_id,
        "reward": rollout.reward,
        "reward_failed": rollout.reward_failed,
        "staleness": staleness,
        "finish_reason": rollout.finish_reason,
        "dropped": rollout.dropped,
        "prompt_ids": list(rollout.prompt_ids),
        "response_ids": list(rollout.response_ids),
        "logprobs": _rounded(rollout.logprobs),
        "versions": list(rollout.versions),
        "loss_mask": mask,
        "advantages": None if advantages is None else _rounded(advantages),
        "drop_reason": None,  # trained on; a dropped rollout kept in the sample says why it was not
    }


def trained(run_dir: Path, group_size: int) -> dict[int, tuple[list[Rollout], list[torch.Tensor]]]:
    """Per step, the logged rollouts it trained on, in the file's order, and the advantages it gave them (the
    whole batch where ``learner.rollout_samples_per_step`` covered it): what a replay of the step takes."""
    steps: dict[int, tuple[list[Rollout], list[torch.Tensor]]] = {}
    for line in (Path(run_dir) / FILE).read_text().splitlines():
        r = json.loads(line)
        if r["drop_reason"] is not None:
            continue
        rollouts, advantages = steps.setdefault(r["step"], ([], []))
        rollouts.append(
            Rollout(
                rollout_id=r["id"],
                group_id=r["group"],
                group_size=group_size,
                prompt_index=r["prompt_index"],
                prompt_ids=r["prompt_ids"],
                response_ids=r["response_ids"],
                logprobs=r["logprobs"],
                versions=r["versions"],
                reward=r["reward"],
                finish_reason=r["finish_reason"],
                generator_id=r["generator"],
                created_s=0.0,
                loss_mask=r["loss_mask"],
            )
        )
        advantages.append(torch.tensor(r["advantages"]))
    return steps
