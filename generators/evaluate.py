"""Held-out evaluation on a generator: the greedy answer and ``k`` samples per prompt, scored and traced.

Run inside the generator loop for the pieces the learner hands out, or alone
on any saved version: ``asyncrl eval CONFIG --weights DIR`` (which runs
``python -m generators.evaluate``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.tasks import prompt_text
from asyncrl.tasks.rewards import as_reward
from asyncrl.weights.folders import ADAPTER_CONFIG
from asyncrl.wire.protocol import EvalTicket, EvalTrace
from generators.base import GenerationRequest, GeneratorBackend, SamplingParams, within

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


def evaluate(
    backend: GeneratorBackend,
    ticket: EvalTicket,
    items: list[dict[str, Any]],
    prompt_ids: Callable[[dict[str, Any]], list[int]],
    reward_fn: Callable[[str, dict[str, Any]], float],
    extract: Callable[[str], str | None] = lambda text: None,
    on_group: Callable[[], None] | None = None,
    between_steps: Callable[[], None] | None = None,
    stop: tuple[str, ...] = (),
) -> list[EvalTrace]:
    """Every trace of one piece: one greedy response and ``ticket.k`` sampled ones per prompt (``on_group``
    is called after each prompt's, twice per prompt in all: a progress bar's step; ``between_steps`` is
    passed to the backend, which calls it between engine steps). ``stop``: the stop strings the policy is
    trained with (``generator.stop``), so that answers are judged as training ends them.

    A reward that fails scores 0 here too, marked ``reward_failed``: an evaluation never stops a generator.
    """
    piece = EvalPiece(ticket, items, prompt_ids, reward_fn, extract, backend.version, stop)
    for params, greedy in piece.runs:
        for request, samples in backend.generate(piece.requests, params, between_steps):
            piece.answered(request, samples, greedy)
            if on_group is not None:
                on_group()
    return piece.traces


class EvalPiece:
    """One piece of a held-out evaluation as its answers come in: the greedy answer and ``ticket.k`` samples
    for every prompt, each scored and traced as it arrives (:func:`evaluate`, or a generator that interleaves
    the piece's requests with its training work).

    A reward that fails scores 0 here too, marked ``reward_failed``: an evaluation never stops a generator.
    """

    def __init__(
        self,
        ticket: EvalTicket,
        items: list[dict[str, Any]],
        prompt_ids: Callable[[dict[str, Any]], list[int]],
        reward_fn: Callable[[str, dict[str, Any]], float],
        extract: Callable[[str], str | None],
        version: int,
        stop: tuple[str, ...] = (),
        started: float = 0.0,
    ) -> None:
        self.ticket, self.items, self.reward_fn, self.extract, self.version = ticket, items, reward_fn, extract, version
        self.requests = [GenerationRequest(f"eval-{i}", prompt_ids(items[i])) for i in ticket.indices]
        self.runs = eval_runs(ticket, stop)
        self.traces: list[EvalTrace] = []
        self.left = len(self.requests) * len(self.runs)  # answers still to come, a prompt's run each
        self.started = started  # when its requests went in, on the caller's clock

    def answered(self, request: GenerationRequest, samples: list[Any], greedy: bool) -> None:
        """One prompt's samples of one run (greedy, or the ``k`` samples), scored."""
        self.left -= 1
        index = int(request.request_id.removeprefix("eval-"))
        item = self.items[index]
        label = None if item.get("label") is None else str(item["label"])
        for sample in samples:
            try:
                reward, failed = as_reward(self.reward_fn(sample.text, item)), False
            except Exception:  # noqa: BLE001  (counted as a failed answer)
                reward, failed = 0.0, True
            self.traces.append(
                EvalTrace(
                    index=index,
                    prompt=prompt_text(item),
                    response=sample.text,
                    answer=self.extract(sample.text),
                    reward=reward,
                    version=min(sample.versions, default=self.version),
                    greedy=greedy,
                    label=label,
                    reward_failed=failed,
                    tokens=len(sample.token_ids),
                )
            )


def evaluate_episodes(
    runner: Any,
    ticket: EvalTicket,
    items: list[dict[str, Any]],
    reward_fn: Callable[[str, dict[str, Any]], float],
    extract: Callable[[str], str | None] = lambda text: None,
    between_steps: Callable[[], None] | None = None,
    stop: tuple[str, ...] = (),
) -> list[EvalTrace]:
    """:func:`evaluate` for a multi-turn task: the same episodes training runs (a
    :class:`generators.episodes.EpisodeRunner`), greedy and ``ticket.k`` sampled, each trace with every turn;
    each turn ends at ``stop`` (``generator.stop``) as training's turns do.

    An episode its environment scored keeps that reward; one it left unscored gets the task's reward on its
    last turn; a dropped one scores 0, marked ``reward_failed``; a truncated one scores as training scores it
    (``episode.truncated``: ``truncated_reward``, or under ``keep`` the task's reward).
    """
    tickets = [(f"eval-{i}", i, items[i]) for i in ticket.indices]
    traces: list[EvalTrace] = []
    for params, greedy in eval_runs(ticket, stop):
        for _, episodes in runner.run(tickets, between_steps or (lambda: None), params):
            for episode in episodes:
                text = episode.last.text if episode.last is not None else ""
                reward, failed = episode.reward, bool(episode.dropped)
                if episode.truncated and runner.settings.truncated != "keep" and not failed:
                    reward = runner.settings.truncated_reward  # unfinished: not an answer to judge
                if reward is None and not failed:
                    try:
                        reward = as_reward(reward_fn(text, episode.item))
                    except Exception:  # noqa: BLE001  (counted as a failed answer)
                        failed = True
                label = episode.item.get("label")
                traces.append(
                    EvalTrace(
                        index=episode.prompt_index,
                        prompt=prompt_text(episode.item),
                        response=text,
                        answer=extract(text),
                        reward=0.0 if failed or reward is None else reward,
                        version=min(episode.versions, default=0),
                        greedy=greedy,
                        label=None if label is None else str(label),
                        reward_failed=failed,
                        turns=[{"role": m["role"], "content": str(m.get("content", ""))} for m in episode.messages],
                        tool_calls=int(episode.metrics.get("tool_calls", 0)),
                        tokens=len(episode.ids),
                    )
                )
    return traces


def eval_runs(ticket: EvalTicket, stop: tuple[str, ...]) -> tuple[tuple[SamplingParams, bool], ...]:
    """The greedy answer, then the ``k`` samples."""
    return (
        (SamplingParams(n=1, max_new_tokens=ticket.max_new_tokens, temperature=0.0, stop=stop), True),
        (
            SamplingParams(n=ticket.k, max_new_tokens=ticket.max_new_tokens, temperature=ticket.temperature, stop=stop),
            False,
        ),
    )


def in_time(reward_fn: Callable[[str, dict[str, Any]], float], timeout_s: float) -> Callable[[str, dict], float]:
    """``reward_fn`` that raises TimeoutError after ``timeout_s`` (``task.reward_timeout_s``; a hung reward is left
    behind in its daemon thread) rather than holding the evaluation."""

    def reward(text: str, item: dict[str, Any]) -> float:
        return within(timeout_s, "reward", reward_fn, text, item)

    return reward


def answer_extractor() -> Callable[[str], str | None]:
    """The final answer as the math reward reads it (``\\boxed{}``, ``#### N`` or the last number)."""
    from asyncrl.tasks.rewards import extract_answer

    return extract_answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl eval", description="evaluate a saved version on the held-out set")
    parser.add_argument("config")
    parser.add_argument(
        "--weights",
        required=True,
        help="an HF folder (a published version or an export), or a LoRA run's PEFT adapter folder",
    )
    parser.add_argument("--out", default=None, help="write every trace here (JSONL); default: WEIGHTS/eval.jsonl")
    args, overrides = parser.parse_known_args(argv)

    from asyncrl.config import load_config
    from asyncrl.observe import logs
    from asyncrl.tasks import open_task
    from generators import open_backend

    logs.setup("eval")
    weights = Path(args.weights)
    adapter = (weights / ADAPTER_CONFIG).is_file()  # evaluated on the config's base model
    config = load_config(args.config, overrides if adapter else [*overrides, f"model.path={args.weights}"])
    missing = _not_a_model_folder(weights) if not adapter else _not_for_adapters(config)
    if missing:
        print(f"asyncrl eval: --weights {args.weights}: {missing}", file=sys.stderr)
        return 2
    backend = open_backend(config)
    if adapter:
        backend.load_folder(weights, 1, config.generator.weight_load_timeout_s)
    task = open_task(config.prompt_task(), backend.tokenizer)
    if not task.eval_items:
        print("asyncrl eval: no held-out prompts: set task.eval_dataset or task.eval_fraction", file=sys.stderr)
        return 2
    count = min(len(task.eval_items), config.eval.max_items or len(task.eval_items))
    ticket = EvalTicket(
        version=backend.version,
        indices=list(range(count)),
        k=config.eval.k,
        temperature=config.eval.temperature,
        max_new_tokens=config.eval.max_new_tokens or config.generator.max_new_tokens,
    )
    from tqdm import tqdm

    from generators.episodes import open_episodes

    episodes = open_episodes(config, backend)
    try:
        with tqdm(total=2 * count, desc="eval", unit="prompt", dynamic_ncols=True) as bar:  # greedy, then k samples
            reward = in_time(task.reward, config.task.reward_timeout_s)
            if episodes is not None:
                stop = tuple(config.generator.stop)
                traces = evaluate_episodes(episodes, ticket, task.eval_items, reward, answer_extractor(), stop=stop)
                bar.update(2 * count)
            else:
                traces = evaluate(
                    backend,
                    ticket,
                    task.eval_items,
                    task.prompt_ids,
                    reward,
                    answer_extractor(),
                    on_group=bar.update,
                    stop=tuple(config.generator.stop),
                )
    finally:
        if episodes is not None:
            episodes.close()
        backend.close()
    return _report(args.weights, args.out or f"{args.weights}/eval.jsonl", traces, ticket.k, config)


def _not_for_adapters(config) -> str | None:
    """Why a LoRA adapter folder cannot be evaluated with ``config``, or None."""
    if not config.learner.lora.enabled:
        return "a LoRA adapter folder: evaluate it with its run's config (learner.lora set), on that base model"
    return None


def _not_a_model_folder(weights: Path) -> str | None:
    """Why ``weights`` is no HF model folder (naming the versions kept next to it), or None when it is one."""
    if (weights / "config.json").is_file():
        return None
    kept = sorted(p.name for p in weights.parent.glob("v*") if (p / "config.json").is_file())
    return "no HF model folder there" + (
        f"; {weights.parent} holds {', '.join(kept)} (a run keeps its last learner.keep_versions)" if kept else ""
    )


def _report(weights: str, out: str, traces: list[EvalTrace], k: int, config: RunConfig) -> int:
    """Print the scores as one JSON line and write every trace to ``out``; 1 when the traces could not be written."""
    import msgspec

    from asyncrl.control.evaluation import score

    pass1, passk, n = score(traces, k, config.task.max_reward)
    try:
        with open(out, "w") as f:
            f.writelines(json.dumps(msgspec.to_builtins(t)) + "\n" for t in traces)
    except OSError as exc:  # a read-only export, a version pruned meanwhile: the scores are printed all the same
        written, error = None, f"asyncrl eval: the traces could not be written to {out} ({exc}); give --out"
    else:
        written, error = out, None
    failures = sum(t.reward_failed for t in traces)
    print(
        json.dumps(
            {
                "weights": weights,
                "prompts": n,
                "pass@1": pass1,
                f"pass@{k}": passk,
                "reward_failures": failures,
                "traces": written,
            }
        )
    )
    if failures:
        print(
            f"asyncrl eval: {failures} of {len(traces)} answers could not be scored (the reward raised or took "
            f"longer than task.reward_timeout_s={config.task.reward_timeout_s:g}); they count as wrong",
            file=sys.stderr,
        )
    if error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
