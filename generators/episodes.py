"""Multi-turn episodes: many in flight at once, each alternating between the engine and its environment.

Every ticket's ``n`` samples are ``n`` episodes of the same item. An episode
starts with its environment's ``reset``; each model turn is one request to
the engine (:mod:`generators.turns`), and each answer of the environment one
call on the environment loop (:mod:`generators.env_loop`). Neither waits for
the other: while some episodes wait on their tools, the engine samples the
rest. A group is handed back as soon as its last episode ends.

Tokens are exact (:class:`asyncrl.envs.chat.ChatRenderer`): the model's as it
sampled them, with their log-probs and versions, the environment's as the
chat template renders them, with mask 0. An environment that raises or runs
out of ``episode.step_timeout_s`` drops its episode with the reason; an
episode that reaches ``episode.max_turns`` or ``episode.max_tokens`` ends
truncated.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from asyncrl.config import EpisodeConfig, RunConfig
from asyncrl.envs import EnvFactory, Feedback, Observation, Turn, parse_tool_calls
from asyncrl.envs.chat import ChatRenderer
from asyncrl.envs.tools import tool_schema
from asyncrl.wire.protocol import EpisodeStats, Rollout, now_s
from generators.base import PromptRefused, Sample, SamplingParams, sampling_params
from generators.env_loop import EnvLoop
from generators.turns import TurnEngine

log = logging.getLogger(__name__)
BATCH_WAIT_S = 0.01  # how long a batching engine waits for one more reply before it samples what it has


@dataclass
class Episode:
    """One trajectory as it grows: the prompt, then every token after it, whose they are and how sampled."""

    key: str
    group_id: str
    prompt_index: int
    item: dict[str, Any]
    env: Any = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation so far, turns as text
    schemas: list[dict[str, Any]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    last: Sample | None = None  # the latest turn
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    dropped: str = ""
    metrics: Counter[str] = field(default_factory=Counter)
    env_s: float = 0.0
    generate_s: float = 0.0
    params: SamplingParams = SamplingParams()  # how its turns are sampled
    waiting: concurrent.futures.Future | None = None  # the environment call in flight
    since: float = 0.0  # when the call in flight, or the turn in flight, started

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add_turn(self, sample: Sample) -> None:
        self.ids += sample.token_ids
        self.mask += [1] * len(sample.token_ids)
        self.logprobs += sample.logprobs
        self.versions += sample.versions
        self.turns += 1
        self.last = sample

    def add_reply(self, token_ids: list[int], version: int) -> None:
        """The environment's tokens: no loss, no log-prob, the version of the model's token before them."""
        self.ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [self.versions[-1] if self.versions else version] * len(token_ids)


class EpisodeRunner:
    """Runs the episodes of a batch of tickets to their end, on one engine and one environment loop."""

    def __init__(
        self,
        settings: EpisodeConfig,
        make_env: EnvFactory,
        renderer: ChatRenderer,
        engine: TurnEngine,
        params: SamplingParams,
        max_tokens: int | None = None,
        version: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.make_env, self.renderer, self.engine = settings, make_env, renderer, engine
        self.params, self.max_tokens, self.version, self._clock = params, max_tokens, version, clock
        self.loop = EnvLoop(settings.workers)
        self.batch_wait_s = BATCH_WAIT_S

    def run(
        self,
        tickets: list[tuple[str, int, dict[str, Any]]],
        between_steps: Callable[[], None],
        params: SamplingParams | None = None,
        refill: Callable[[], list[tuple[str, int, dict[str, Any]]]] | None = None,
        refill_below: int = 0,
    ) -> Iterator[tuple[str, list[Episode]]]:
        """``(group_id, episodes)`` for every ticket ``(group_id, prompt_index, item)``, as each group ends;
        ``params`` (evaluation's greedy or k samples) replaces the generator's sampling for this call.

        With ``refill``, more tickets are taken whenever fewer than ``refill_below`` episodes are in flight,
        and their episodes start at once: the engine never waits for a batch's slowest episode, and the
        episodes' waits on their tools fall at different times. The run ends once ``refill`` has none.
        """
        params = params or self.params
        groups: dict[str, list[Episode]] = {}
        live: dict[str, Episode] = {}
        self._start(tickets, params, groups, live)
        try:
            while groups:
                self._turn(live, between_steps)
                for group_id in [g for g, episodes in groups.items() if all(e.done for e in episodes)]:
                    for episode in groups[group_id]:
                        del live[episode.key]
                    yield group_id, groups.pop(group_id)
                if refill is not None and len(live) < refill_below:
                    self._start(refill(), params, groups, live)
        finally:
            self.engine.abort(list(live))  # a caller that stops early leaves no turn in the engine

    def _start(self, tickets, params: SamplingParams, groups: dict, live: dict) -> None:
        """Every ticket's ``params.n`` episodes, each started with its environment's reset."""
        for group_id, index, item in tickets:
            groups[group_id] = [
                Episode(f"{group_id}-{i}", group_id, index, item, params=params) for i in range(params.n)
            ]
            for episode in groups[group_id]:
                live[episode.key] = episode
                self._call(episode, self._reset, episode)

    def _turn(self, live: dict[str, Episode], between_steps: Callable[[], None]) -> None:
        """One round: take the environments' answers, then one engine step (or, with nothing to sample, a wait
        for the next answer)."""
        for episode in [e for e in live.values() if e.waiting is not None and e.waiting.done()]:
            self._answered(episode)
        waiting = [e.waiting for e in live.values() if e.waiting is not None]
        if self.engine.busy and (self.engine.continuous or not waiting or not self._more_soon(waiting)):
            for key, sample in self.engine.step(between_steps):
                self._turn_done(live[key], sample)
        elif waiting and not self.engine.busy:
            concurrent.futures.wait(waiting, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED)
            between_steps()

    def _more_soon(self, waiting: list[concurrent.futures.Future]) -> bool:
        """An engine that samples turns in batches waits a moment (``batch_wait_s``) for more replies: a burst
        of quick environment steps then becomes one batch rather than a batch each."""
        done, _ = concurrent.futures.wait(
            waiting, timeout=self.batch_wait_s, return_when=concurrent.futures.FIRST_COMPLETED
        )
        return bool(done)

    # ------------------------------------------------------------------ the environment's side
    def _reset(self, episode: Episode) -> Observation:
        """Made and reset in the loop's thread: a constructor may load data or open a connection."""
        episode.env = self.make_env(episode.item)
        return episode.env.reset()

    def _call(self, episode: Episode, fn: Callable[..., Any], *args: Any) -> None:
        episode.since = self._clock()
        episode.waiting = self.loop.submit(fn, *args, timeout_s=self.settings.step_timeout_s)

    def _answered(self, episode: Episode) -> None:
        """An environment call returned: start the first turn, append its reply and go on, or end."""
        call, episode.waiting = episode.waiting, None
        episode.env_s += self._clock() - episode.since
        what = "reset" if episode.last is None else "step"
        try:
            answer = call.result()
        except TimeoutError:
            return self._drop(episode, f"{what} took longer than {self.settings.step_timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001  (a user's environment: its episode is dropped, the run goes on)
            return self._drop(episode, f"{what} raised {type(exc).__name__}: {exc}")
        if episode.last is None:
            return self._started(episode, answer)
        self._stepped(episode, answer)

    def _started(self, episode: Episode, observation: Any) -> None:
        if not isinstance(observation, Observation):
            return self._drop(episode, f"reset returned {type(observation).__name__}, not an Observation")
        try:
            episode.messages = list(observation.messages)
            episode.schemas = [tool_schema(tool) for tool in observation.tools]
            episode.prompt_ids = self.renderer.prompt(episode.messages, episode.schemas)
            episode.prompt_ids += self.renderer.encode(self.settings.first_turn_prefix)
        except Exception as exc:  # noqa: BLE001  (a tool without a schema, a template that refuses the messages)
            return self._drop(episode, f"its first messages cannot be rendered: {exc}")
        self._next_turn(episode)

    def _stepped(self, episode: Episode, feedback: Any) -> None:
        if not isinstance(feedback, Feedback):
            return self._drop(episode, f"step returned {type(feedback).__name__}, not a Feedback")
        try:  # numpy numbers would not go on the wire
            metrics = {str(name): float(value) for name, value in dict(feedback.metrics).items()}
            reward = None if feedback.reward is None else float(feedback.reward)
        except (TypeError, ValueError) as exc:
            return self._drop(episode, f"step returned a reward or metric that is not a number: {exc}")
        episode.metrics.update(metrics)
        episode.messages.append({"role": "assistant", "content": episode.last.text})
        if feedback.done:
            episode.reward, episode.done = reward, True
            return
        if episode.turns >= self.settings.max_turns:  # the environment wants more than the episode may have
            return self._truncate(episode)
        try:
            reply = self.renderer.reply(
                episode.messages[:-1], episode.last.token_ids, feedback.messages, episode.schemas
            )
        except Exception as exc:  # noqa: BLE001  (messages the chat template refuses)
            return self._drop(episode, f"its messages cannot be rendered: {exc}")
        episode.messages += feedback.messages
        if self.max_tokens is not None and episode.length + len(reply) >= self.max_tokens:
            return self._truncate(episode)
        episode.add_reply(reply, self.version())
        self._next_turn(episode)

    # ------------------------------------------------------------------ the engine's side
    def _next_turn(self, episode: Episode) -> None:
        if episode.turns >= self.settings.max_turns:
            return self._truncate(episode)
        budget = episode.params.max_new_tokens
        if self.max_tokens is not None:
            budget = min(budget, self.max_tokens - episode.length)
        if budget <= 0:
            if episode.turns == 0:  # nothing sampled to train on: as a prompt the engine refuses, not a truncation
                return self._drop(
                    episode,
                    f"its first prompt ({episode.length} tokens, the environment's tools included) leaves no room "
                    f"to answer within {self.max_tokens} tokens (episode.max_tokens, or generator.vllm.max_model_len)",
                )
            return self._truncate(episode)
        try:
            self.engine.add(episode.key, episode.prompt_ids + episode.ids, _with_budget(episode.params, budget))
        except PromptRefused as exc:
            if episode.turns == 0:
                return self._drop(episode, f"the engine refused its prompt: {exc}")
            return self._truncate(episode)
        episode.since = self._clock()

    def _turn_done(self, episode: Episode, sample: Sample) -> None:
        episode.generate_s += self._clock() - episode.since
        if episode.turns == 0 and self.settings.first_turn_prefix:  # the turn as the model sees it: prefix first
            sample = replace(sample, text=self.settings.first_turn_prefix + sample.text)
        episode.add_turn(sample)
        try:
            calls = parse_tool_calls(sample.text)
        except Exception as exc:  # noqa: BLE001  (a turn no reading should crash on: its episode alone is dropped)
            return self._drop(episode, f"its turn's tool calls could not be read: {exc}")
        turn = Turn(sample.text, calls, sample.finish_reason, episode.turns - 1)
        self._call(episode, episode.env.step, turn)

    def _truncate(self, episode: Episode) -> None:
        episode.truncated = episode.done = True

    def _drop(self, episode: Episode, why: str) -> None:
        log.warning("episode %s (prompt %d) dropped: %s", episode.key, episode.prompt_index, why)
        episode.dropped, episode.done = why, True

    def close(self) -> None:
        self.loop.close()


def _with_budget(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
    return replace(params, n=1, max_new_tokens=max_new_tokens)


def episode_rollout(
    episode: Episode, group_size: int, reward: float | None, settings: EpisodeConfig, generator_id: str, took_s: float
) -> Rollout:
    """The one rollout an episode travels as; ``reward`` None: it failed to score (or was dropped).

    A truncated episode is masked or penalised as ``episode.truncated`` says;
    either way its reward is ``episode.truncated_reward``, which a masked one
    contributes to its group's baseline only.
    """
    mask = episode.mask
    if episode.truncated and settings.truncated != "keep":
        reward = settings.truncated_reward
    if episode.truncated and settings.truncated == "mask":
        mask = [0] * len(episode.ids)
    last = episode.last
    return Rollout(
        rollout_id=episode.key,
        group_id=episode.group_id,
        group_size=group_size,
        prompt_index=episode.prompt_index,
        prompt_ids=episode.prompt_ids,
        response_ids=episode.ids,
        logprobs=episode.logprobs,
        versions=episode.versions,
        reward=0.0 if reward is None else reward,
        reward_failed=reward is None,
        finish_reason="length" if episode.truncated or last is None else last.finish_reason,
        generator_id=generator_id,
        created_s=now_s(),
        generate_s=took_s,
        loss_mask=mask,
        episode=EpisodeStats(
            episode.turns, episode.truncated, episode.env_s, episode.generate_s, dict(episode.metrics)
        ),
        dropped=episode.dropped,
    )


def open_episodes(config: RunConfig, backend: Any) -> EpisodeRunner | None:
    """The runner of a multi-turn task's episodes on ``backend``; None for a single-turn task.

    An episode's token budget is ``episode.max_tokens``, else the engine's
    ``generator.vllm.max_model_len`` where set.
    """
    from asyncrl.envs import environment_factory
    from generators.turns import turn_engine

    make_env = environment_factory(config.task, config.episode.tool_timeout_s)
    if make_env is None:
        return None
    max_tokens = config.episode.max_tokens
    if max_tokens is None and config.generator.backend != "transformers":
        max_tokens = config.generator.vllm.max_model_len
    return EpisodeRunner(
        config.episode,
        make_env,
        ChatRenderer(backend.tokenizer, config.episode.tool_format),
        turn_engine(backend),
        sampling_params(config.generator),
        max_tokens=max_tokens,
        version=lambda: backend.version,
    )
