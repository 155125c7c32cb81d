"""What ``asyncrl view`` reads from a run folder: curves, the pipeline's state and the kept rollouts.

Every read goes through :class:`RunFolder`, which names the files it reads
itself (the browser sends step numbers, versions and rollout ids, never
paths) and refuses any path outside the folder. A run still going, one still
starting, or one from an older asyncrl lacks some files or has a half-written
last line: what is there is shown, and what is missing is said.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.launch.viewer import lines
from asyncrl.launch.viewer.tail import Tail, find_line, read_at

log = logging.getLogger(__name__)

# The files a viewer reads, and what each gives (said when one is missing).
FILES = {
    "config.yaml": "the run's settings (written as it starts)",
    "metrics.jsonl": "the training curves (one line per step)",
    "summary.json": "the run's totals (written when it ends)",
    "consumed.jsonl": "what each step trained on",
    "dropped.jsonl": "the rollouts dropped, by reason",
    "eval.jsonl": "held-out evaluation (eval.every_steps)",
    "rollouts.jsonl": "rollouts kept with their tokens (learner.rollout_samples_per_step; newer runs)",
}
# A learner's wait for its batch, by cause (metrics.jsonl), as the curves show it.
WAITS = ("wait_rollouts_s", "wait_buffer_s", "wait_housekeeping_s", "wait_other_s")
RATE_WINDOW = 10  # steps over which the samples/s curves are measured
SERIES = ("reward", "wall_s", "samples_per_s", "staleness_mean", "staleness_max", "step_s", "response_len", *WAITS)


def _rates(records: list[dict], window: int = RATE_WINDOW) -> dict[str, list[float | None]]:
    """Samples/s over the last ``window`` steps at each step: trained (the learner's ``samples``) and generated
    (the generators' reported total, ``generated_samples``; None in runs that did not record it)."""
    trained, total = [], 0
    for r in records:
        total += r.get("samples") or 0
        trained.append(total)
    generated = [r.get("generated_samples") for r in records]
    wall = [r.get("wall_s") for r in records]

    def rate(counts: list) -> list[float | None]:
        out: list[float | None] = []
        for i in range(len(records)):
            j = max(0, i - window)
            values = (counts[i], counts[j], wall[i], wall[j])
            if i == j or any(not isinstance(v, int | float) for v in values) or wall[i] <= wall[j]:
                out.append(None)
            elif counts[i] < counts[j]:  # a resumed learner counts from 0 again
                out.append(None)
            else:
                out.append((counts[i] - counts[j]) / (wall[i] - wall[j]))
        return out

    return {"window": window, "trained": rate(trained), "generated": rate(generated)}


class RunFolder:
    """One run folder, read as it grows on every call (a live run keeps writing it)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self._tokenizer: Any = None
        self._tokenizer_tried = False
        self._tails: dict[str, Tail] = {}
        self._transport: tuple[int, str | None] | None = None  # (config.yaml's mtime, what it resolved to)
        self._lock = threading.Lock()  # the server answers requests on several threads

    def path(self, name: str) -> Path:
        """``name`` inside the folder; ValueError for anything that would leave it."""
        path = (self.root / name).resolve()
        if path != self.root and self.root not in path.parents:
            raise ValueError(f"{name!r} is outside the run folder")
        return path

    def jsonl(self, name: str) -> tuple[list[dict], int]:
        """The records of a JSONL file (none if it is missing) and how many lines did not parse (a torn last
        line of a file being written, or damage). Only what was appended since the last call is parsed."""
        return self._read(name, Tail)

    def _read(self, name: str, make: Callable[[], Tail]) -> tuple[Any, int]:
        path = self.path(name)
        with self._lock:
            tail = self._tails.setdefault(name, make())
            return tail.read(path)

    def _rows(self) -> tuple[list[dict], int]:
        """rollouts.jsonl as the list shows it: a few fields of each kept rollout and where its line starts (its
        tokens are read from the file when one is opened, so a long run's sample is not held in memory)."""
        return self._read("rollouts.jsonl", lambda: Tail(lines.row, decode=lines.decode_row))

    def json(self, name: str) -> dict | None:
        path = self.path(name)
        try:
            value = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def config(self) -> dict:
        """The run's config.yaml as a dict (empty when missing or unreadable)."""
        import yaml

        try:
            value = yaml.safe_load(self.path("config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return value if isinstance(value, dict) else {}

    # ------------------------------------------------------------------ what the page asks for
    def overview(self) -> dict:
        """The run's name, whether it has ended, and which files are missing (with what they would give)."""
        if not self.root.is_dir():
            return {"run_dir": str(self.root), "exists": False, "missing": {}, "notes": ["no such folder"]}
        config = self.config()
        missing = {name: what for name, what in FILES.items() if not self.path(name).exists()}
        notes = []
        if "config.yaml" in missing and "metrics.jsonl" in missing:
            notes.append("nothing written yet: a run that is still starting, or not a run folder")
        elif "metrics.jsonl" in missing:
            notes.append("no step trained yet")
        return {
            "run_dir": str(self.root),
            "exists": True,
            "name": config.get("name", self.root.name),
            "ended": "summary.json" not in missing,
            "missing": missing,
            "notes": notes,
        }

    def curves(self) -> dict:
        """Per-step series from metrics.jsonl, evaluations, drops by reason and staleness over time."""
        records, bad = self.jsonl("metrics.jsonl")
        out: dict[str, Any] = {"step": [r.get("step") for r in records], "bad_lines": {"metrics.jsonl": bad}}
        for key in SERIES:
            out[key] = [r.get(key) for r in records]
        out["rates"] = _rates(records)
        evals, out["bad_lines"]["eval.jsonl"] = self.jsonl("eval.jsonl")
        # written as evaluations finish, not in step order (a record without a step goes last)
        evals = sorted(evals, key=lambda e: e.get("step") if isinstance(e.get("step"), int) else float("inf"))
        k = next((key for e in evals for key in e if key.startswith("pass@") and key != "pass@1"), None)
        out["eval"] = {
            "step": [e.get("step") for e in evals],
            "version": [e.get("version") for e in evals],
            "pass@1": [e.get("pass@1") for e in evals],
            "pass@k": [e.get(k) for e in evals] if k else [],
            "k": k,
        }
        wall = {0: 0.0, **{r.get("step"): r.get("wall_s") for r in records}}  # step 0: the start, before any step
        out["eval"]["wall_s"] = [wall.get(e.get("step")) for e in evals]
        drops, out["bad_lines"]["dropped.jsonl"] = self._read(
            "dropped.jsonl", lambda: Tail(lines.dropped, tally=True, decode=lines.decode_dropped)
        )
        summary = self.json("summary.json") or {}
        out["drops"] = dict(drops) or summary.get("samples_dropped") or {}
        out["staleness"] = self._staleness_by_step()
        return out

    def _staleness_by_step(self) -> dict:
        """How many rollouts each step trained on at each staleness: the histogram over time."""
        counts, _ = self._read("consumed.jsonl", lambda: Tail(lines.trained, tally=True, decode=lines.decode_trained))
        levels = sorted({s for _, s in counts if s is not None})
        steps = sorted({step for step, _ in counts if step is not None})
        return {"step": steps, "levels": levels, "counts": [[counts[(st, lv)] for st in steps] for lv in levels]}

    def pipeline(self) -> dict:
        """The run's totals when it has ended; its latest step's numbers while it runs."""
        summary = self.json("summary.json")
        records, _ = self.jsonl("metrics.jsonl")
        last = records[-1] if records else {}
        keys = (
            "achieved_samples_per_s",
            "generator_capacity_samples_per_s",
            "learner_capacity_samples_per_s",
            "pipeline_efficiency",
            "samples_consumed",
            "samples_dropped",
            "steps",
            "version",
            "wall_s",
            "max_staleness",
            "staleness_max_observed",
        )
        return {
            "ended": summary is not None,
            "live": None if summary is not None else self.live(),
            "summary": {k: summary.get(k) for k in keys if k in summary} if summary else None,
            "latest_step": last,
            "weights": {
                "transport": self.transport(),
                "version": last.get("version"),
                "at_step": last.get("step"),
                **{k: v for k, v in last.items() if k.startswith(("publish", "push"))},
            },
        }

    def transport(self) -> str | None:
        """How the run's versions travel (push, served, shared or folder), as its config resolves it; None while
        there is no config.yaml (a run still starting) or for one this asyncrl cannot read (older, or damaged).
        Read again whenever config.yaml changes."""
        from asyncrl.config import load_config
        from asyncrl.weights.transports import transport_of

        path = self.path("config.yaml")
        try:
            written = path.stat().st_mtime_ns
        except OSError:
            return None
        if self._transport is None or self._transport[0] != written:
            try:
                self._transport = (written, transport_of(load_config(path)))
            except Exception as exc:  # noqa: BLE001  (shown as unknown)
                log.info("asyncrl view: the run's weight transport is unknown: %s", exc)
                self._transport = (written, None)
        return self._transport[1]

    def live(self, timeout_s: float = 1.0) -> dict | None:
        """A running learner's snapshot (what ``asyncrl status`` shows), asked of the coordinator address in the
        run's config.yaml; None once the run has ended, or when the learner does not answer in ``timeout_s``."""
        import msgspec

        from asyncrl.control.client import CoordinatorClient, RemoteError
        from asyncrl.wire.protocol import Status, StatusRequest

        coordinator = self.config().get("coordinator") or {}
        if self.path("summary.json").exists() or not coordinator.get("address"):
            return None
        try:
            client = CoordinatorClient(coordinator["address"], timeout_s, coordinator.get("curve_secret_file"))
        except Exception as exc:  # noqa: BLE001  (a bad address or secret in an old config: no live view)
            log.warning("asyncrl view: no live status from %s: %s", coordinator["address"], exc)
            return None
        try:
            snapshot = msgspec.to_builtins(client.call(StatusRequest(), Status))
        except (TimeoutError, RemoteError):
            return None
        finally:
            client.close()
        if coordinator.get("run_id") and snapshot["run_id"] and snapshot["run_id"] != coordinator["run_id"]:
            return None  # the run ended without a summary, and another now answers at its address
        for g in snapshot["generators"]:  # as asyncrl status judges them
            age = snapshot["now_s"] - g["last_seen_s"]
            lease = snapshot["generator_lease_s"] or float("inf")
            g["state"] = "alive" if age < lease / 4 else "quiet" if age < lease else "lost"
            g["seen_s_ago"] = age
        snapshot["in_flight"] = snapshot["samples_admitted"] - snapshot["samples_consumed"]
        return snapshot

    def eval_item(self, index: int) -> list[dict]:
        """One held-out prompt's answers at every evaluated version, oldest first: ``{version, traces}``."""
        folder = self.path("eval")
        if not folder.is_dir():
            return []
        out = []
        for path in sorted(folder.glob("v*.jsonl")):
            traces, _ = self.jsonl(f"eval/{path.name}")
            mine = [t for t in traces if t.get("index") == index]
            if mine:
                out.append({"version": mine[0].get("version"), "file": path.name, "traces": mine})
        return out

    def rollouts(
        self,
        step: int | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        staleness: int | None = None,
        kept: str | None = None,
        prompt: int | None = None,
    ) -> dict:
        """The kept rollouts (without their tokens), filtered; the steps that have some, and the drop reasons.

        ``kept``: ``"trained"`` for the rollouts trained on, a drop reason (``"stale"``...) for those dropped
        for it, None for both. ``prompt``: one prompt's groups (its index in the task)."""
        records, bad = self._rows()
        steps = sorted({r.get("step") for r in records if isinstance(r.get("step"), int)})
        reasons = sorted({r["drop_reason"] for r in records if isinstance(r.get("drop_reason"), str)})
        chosen = [
            r
            for r in records
            if (step is None or r.get("step") == step)
            and (min_reward is None or (r.get("reward") or 0.0) >= min_reward)
            and (max_reward is None or (r.get("reward") or 0.0) <= max_reward)
            and (staleness is None or r.get("staleness") == staleness)
            and (kept is None or (r.get("drop_reason") or "trained") == kept)
            and (prompt is None or r.get("prompt_index") == prompt)
        ]
        rows = chosen[:500]
        more = max(0, len(chosen) - len(rows))
        return {"steps": steps, "drop_reasons": reasons, "rows": rows, "more": more, "bad_lines": bad}

    def rollout(self, rollout_id: str, at: int | None = None) -> dict | None:
        """One kept rollout, every response token with its text, version, log-prob, advantage and mask; and the
        step consumed.jsonl says trained on it. ``at``: its row's ``at`` (a rollout dropped as a duplicate is
        kept beside the copy trained on, under the same id); unset, the first with the id."""
        rows, _ = self._rows()
        row = next((r for r in rows if r["id"] == rollout_id and (at is None or r["at"] == at)), None)
        found = None if row is None else read_at(self.path("rollouts.jsonl"), row["at"])
        if found is None or found.get("id") != rollout_id:
            return None
        trained = None if found.get("drop_reason") else self._consumed(rollout_id)
        ids = found.get("response_ids") or []
        columns = {key: found.get(key) or [None] * len(ids) for key in ("logprobs", "versions", "loss_mask")}
        advantages = found.get("advantages") or [None] * len(ids)
        learner = found.get("learner_logprobs") or [None] * len(ids)  # older runs and other ranks' rollouts: none
        texts = self.token_texts(ids)
        tokens = [
            {
                "id": token,
                "text": texts[i],
                "version": columns["versions"][i],
                "logprob": columns["logprobs"][i],
                "learner_logprob": learner[i] if i < len(learner) else None,
                "mask": columns["loss_mask"][i],
                "advantage": advantages[i] if i < len(advantages) else None,
            }
            for i, token in enumerate(ids)
        ]
        prompt = self.token_texts(found.get("prompt_ids") or [])
        return {
            **{k: v for k, v in found.items() if not isinstance(v, list)},
            "prompt": "".join(prompt),
            "tokens": tokens,
            "consumed": trained,
        }

    def _consumed(self, rollout_id: str) -> dict | None:
        """consumed.jsonl's line for ``rollout_id``, looked for in the file (one rollout opened at a time: the
        file is not held in memory)."""
        needle = json.dumps(rollout_id).encode()
        return find_line(self.path("consumed.jsonl"), needle, lambda record: record.get("id") == rollout_id)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text, by the run's tokenizer where it loads (its ``model.path``), else ``<id>``."""
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return [f"<{i}>" for i in ids]
        return [tokenizer.decode([i]) for i in ids]

    def tokenizer(self) -> Any:
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            model = (self.config().get("model") or {}).get("path")
            if model:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(model)
                except Exception as exc:  # noqa: BLE001  (ids are shown instead)
                    log.warning("the run's tokenizer (%s) did not load, showing token ids: %s", model, exc)
        return self._tokenizer

    def eval_traces(self, version: int) -> list[dict]:
        """The traces of the evaluation of ``version`` (eval/vNNNNNN.jsonl): every prompt's answers."""
        for name in (f"eval/v{version:06d}.jsonl", f"eval/v{version}.jsonl"):
            records, _ = self.jsonl(name)
            if records:
                return records
        return []
