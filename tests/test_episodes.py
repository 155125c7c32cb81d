"""The episode runner: turns and environment replies laid end to end, token-exact, with the loss mask, per-token
versions across a weight update, drops with their reason, truncation, and episodes that do not wait on one
another."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
from conftest import ROOT
from transformers import AutoTokenizer

from asyncrl.config import EpisodeConfig
from asyncrl.envs import Feedback, Observation
from asyncrl.envs.chat import ChatRenderer
from asyncrl.envs.hint import HintEnv
from asyncrl.envs.tool_env import MethodsAsTools
from generators.base import PromptRefused, Sample, SamplingParams
from generators.episodes import Episode, EpisodeRunner, episode_rollout

TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-agent")
CALL = TOKENIZER.convert_tokens_to_ids('<tool_call>\n{"name": "hint", "arguments": {}}\n</tool_call>')
EOS = TOKENIZER.eos_token_id


class ScriptedEngine:
    """A turn engine that answers every turn it holds at each step, from ``script(key, prompt_ids)``."""

    continuous = True

    def __init__(self, script) -> None:
        self.script, self.version = script, 0
        self.waiting: dict[str, list[int]] = {}
        self.budgets: list[int] = []
        self.refuse_over: int | None = None
        self.answered = self.steps = 0

    def add(self, key: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.refuse_over is not None and len(prompt_ids) > self.refuse_over:
            raise PromptRefused("longer than max_model_len")
        self.waiting[key] = prompt_ids
        self.budgets.append(params.max_new_tokens)

    def step(self, between_steps) -> list[tuple[str, Sample]]:
        done = [(key, self.script(key, ids, self.version)) for key, ids in self.waiting.items()]
        self.answered += len(done)
        self.steps += 1
        self.waiting.clear()
        between_steps()
        return done

    def abort(self, keys) -> None:
        for key in keys:
            self.waiting.pop(key, None)

    @property
    def busy(self) -> bool:
        return bool(self.waiting)


def sample(tokens: list[int], version: int) -> Sample:
    text = TOKENIZER.decode(tokens, skip_special_tokens=True)
    return Sample(tokens, [-0.5] * len(tokens), [version] * len(tokens), "stop", text)


def call_then_copy(key: str, ids: list[int], version: int) -> Sample:
    """The learned policy: call the hint first, then repeat the digits of the tool's reply."""
    if CALL not in ids:
        return sample([CALL, EOS], version)
    digits = TOKENIZER.decode(ids).split("tool\n")[-1][:3]
    return sample(TOKENIZER.encode(digits, add_special_tokens=False) + [EOS], version)


def runner(make_env, engine, n: int = 2, **settings) -> EpisodeRunner:
    return EpisodeRunner(
        EpisodeConfig(**{"step_timeout_s": 5.0, **settings}),
        make_env,
        ChatRenderer(TOKENIZER, "template"),
        engine,
        SamplingParams(n=n, max_new_tokens=4),
        version=lambda: engine.version,
    )


def hint_env(item):
    return HintEnv(item)


def run_all(r: EpisodeRunner, tickets, between=lambda: None) -> dict[str, list[Episode]]:
    try:
        return dict(r.run(tickets, between))
    finally:
        r.close()


def test_an_episode_is_its_turns_and_the_templates_replies_with_the_environments_tokens_masked():
    engine = ScriptedEngine(call_then_copy)
    [episodes] = run_all(runner(hint_env, engine, n=1), [("g0", 0, {"prompt": "?", "answer": "583"})]).values()
    [episode] = episodes
    assert episode.done and not episode.dropped and not episode.truncated and episode.turns == 2
    assert episode.reward == 1.0  # the environment scored it
    conversation = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": TOKENIZER.decode([CALL])},
        {"role": "tool", "content": "583"},
        {"role": "assistant", "content": "583"},
    ]
    whole = TOKENIZER.apply_chat_template(conversation, tokenize=False)
    assert episode.prompt_ids + episode.ids == TOKENIZER.encode(whole, add_special_tokens=False)[:-1]  # no last \n
    reply = len(episode.ids) - 2 - 4
    assert episode.mask == [1, 1] + [0] * reply + [1, 1, 1, 1]
    assert episode.logprobs == [-0.5, -0.5] + [0.0] * reply + [-0.5] * 4
    assert episode.metrics["tool_calls"] == 1


def test_a_weight_update_between_turns_is_recorded_per_token():
    engine = ScriptedEngine(call_then_copy)

    def between():  # the update lands once the first turn is sampled
        engine.version = 1 if engine.answered else 0

    [episodes] = run_all(runner(hint_env, engine, n=1), [("g0", 0, {"prompt": "?", "answer": "583"})], between).values()
    [episode] = episodes
    reply = len(episode.ids) - 6
    assert episode.versions == [0, 0] + [0] * reply + [1, 1, 1, 1]  # the reply keeps the version before it
    rollout = episode_rollout(episode, 1, episode.reward, EpisodeConfig(), "gen", 0.1)
    assert rollout.oldest_version == 0 and rollout.problem(vocab_size=len(TOKENIZER)) is None
    assert rollout.trained_tokens == 6


class Raises:
    def __init__(self, item, when: str) -> None:
        self.when = item["when"]

    def reset(self):
        if self.when == "reset":
            raise ConnectionError("sandbox unreachable")
        if self.when == "no_messages":
            return Observation(None)  # item.get("messages") of an item without them
        return Observation([{"role": "user", "content": "?"}])

    def step(self, turn):
        if self.when == "step":
            raise KeyError("state")
        if self.when == "exit":
            raise SystemExit(3)  # argparse on input it refuses: it would end the environment loop
        if self.when == "wrong":
            return "not feedback"
        if self.when == "none_metric":
            return Feedback(reward=1.0, done=True, metrics={"latency": None})
        return Feedback(reward=1.0, done=True)


@pytest.mark.parametrize(
    ("when", "why"),
    [
        ("reset", "reset raised ConnectionError: sandbox unreachable"),
        ("step", "step raised KeyError: 'state'"),
        ("wrong", "step returned str, not a Feedback"),
        ("exit", "step raised RuntimeError: SystemExit: 3"),
        ("no_messages", "its first messages cannot be rendered: 'NoneType' object is not iterable"),
        (
            "none_metric",
            "step returned a reward or metric that is not a number: float() argument must be a string or a real "
            "number, not 'NoneType'",
        ),
    ],
)
def test_an_environment_that_fails_drops_its_episode_with_the_reason_and_the_rest_go_on(when, why):
    engine = ScriptedEngine(call_then_copy)
    tickets = [("bad", 0, {"when": when}), ("good", 1, {"when": "never"})]
    groups = run_all(runner(lambda item: Raises(item, item["when"]), engine, n=2), tickets)
    assert [e.dropped for e in groups["bad"]] == [why, why]
    assert [(e.dropped, e.reward) for e in groups["good"]] == [("", 1.0), ("", 1.0)]
    rollout = episode_rollout(groups["bad"][0], 2, None, EpisodeConfig(), "gen", 0.1)
    assert rollout.dropped == why and rollout.reward_failed
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(rollout), type=type(rollout))
    assert decoded.problem() is None  # it travels, and the learner drops it with its reason


class NumpyNumbers:
    def __init__(self, item) -> None:
        pass

    def reset(self):
        return Observation([{"role": "user", "content": "?"}])

    def step(self, turn):
        import numpy

        return Feedback(reward=numpy.float32(1.0), done=True, metrics={"hits": numpy.int64(2)})


def test_an_environments_numpy_reward_and_metrics_travel_as_plain_numbers():
    [episodes] = run_all(runner(NumpyNumbers, ScriptedEngine(call_then_copy), n=1), [("g", 0, {})]).values()
    rollout = episode_rollout(episodes[0], 1, episodes[0].reward, EpisodeConfig(), "gen", 0.1)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(rollout), type=type(rollout))  # numpy's would not
    assert (decoded.reward, decoded.episode.metrics) == (1.0, {"hits": 2.0})


class Stuck:
    def __init__(self, item) -> None:
        self.release = item["release"]

    def reset(self):
        return Observation([{"role": "user", "content": "?"}])

    async def step(self, turn):
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
        return Feedback(reward=0.5, done=True)


@pytest.mark.realtime
def test_an_environment_step_past_its_time_limit_drops_the_episode():
    release = threading.Event()
    engine = ScriptedEngine(call_then_copy)
    try:
        groups = run_all(runner(Stuck, engine, n=1, step_timeout_s=0.2), [("g", 0, {"release": release})])
    finally:
        release.set()
    assert groups["g"][0].dropped == "step took longer than 0.2s"


class Slow:
    """Episodes of a slow item wait in their first step until the fast items' group has been handed back."""

    def __init__(self, item, handed_back: threading.Event) -> None:
        self.item, self.handed_back = item, handed_back

    def reset(self):
        return Observation([{"role": "user", "content": "?"}])

    def step(self, turn):
        if self.item["slow"]:
            assert self.handed_back.wait(10), "the fast episodes were held up by the slow ones"
            return Feedback(reward=0.0, done=True)
        if turn.index < 2:
            return Feedback([{"role": "tool", "content": "1"}])
        return Feedback(reward=1.0, done=True)


def test_episodes_waiting_on_their_environment_do_not_hold_the_others_up():
    handed_back = threading.Event()
    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))
    tickets = [("slow", 0, {"slow": True}), ("fast", 1, {"slow": False})]
    order, dropped = [], []
    for group, episodes in runner(lambda item: Slow(item, handed_back), engine, n=2).run(tickets, lambda: None):
        order.append(group)
        dropped += [e.dropped for e in episodes if e.dropped]
        handed_back.set()
    assert order == ["fast", "slow"] and dropped == []  # three turns each while the slow ones' first step waited


def test_an_engine_that_samples_in_batches_gets_a_bursts_turns_together():
    engine = ScriptedEngine(call_then_copy)
    engine.continuous = False
    r = runner(hint_env, engine, n=8)
    r.batch_wait_s = 5.0  # returns at each reply: a wait that only a loaded machine's slowness could outlast
    run_all(r, [("g", 0, {"prompt": "?", "answer": "583"})])
    assert engine.answered == 16 and engine.steps == 2  # two turns of 8 episodes: two batches, not 16


def test_an_episode_past_max_turns_is_truncated_and_masked_or_penalised():
    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))  # calls the hint forever
    [episodes] = run_all(
        runner(hint_env, engine, n=1, max_turns=3), [("g", 0, {"prompt": "?", "answer": "1"})]
    ).values()
    [episode] = episodes
    assert episode.truncated and episode.turns == 3 and episode.reward is None
    assert episode.ids[-1] == EOS  # the third turn's reply is never rendered: nothing answers it
    masked = episode_rollout(episode, 1, None, EpisodeConfig(truncated="mask"), "gen", 0.1)
    assert masked.loss_mask == [0] * len(episode.ids) and masked.reward == 0.0 and not masked.reward_failed
    penalised = episode_rollout(episode, 1, None, EpisodeConfig(truncated="penalty", truncated_reward=-1.0), "g", 0.1)
    assert penalised.loss_mask == episode.mask and penalised.reward == -1.0
    kept = episode_rollout(episode, 1, 0.25, EpisodeConfig(truncated="keep"), "gen", 0.1)
    assert kept.reward == 0.25 and kept.finish_reason == "length"


def test_the_token_budget_shrinks_each_turn_and_ends_the_episode_when_spent():
    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))
    r = runner(hint_env, engine, n=1, max_turns=10)
    r.max_tokens = 30
    [episodes] = run_all(r, [("g", 0, {"prompt": "?", "answer": "1"})]).values()
    [episode] = episodes
    assert episode.truncated and episode.length <= 30
    assert engine.budgets[0] == 4 and all(b <= 4 for b in engine.budgets)


def test_a_prompt_the_engine_refuses_drops_the_episode_and_a_later_turn_truncates_it():
    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))
    engine.refuse_over = 3
    [episodes] = run_all(runner(hint_env, engine, n=1), [("g", 0, {"prompt": "?", "answer": "1"})]).values()
    assert episodes[0].dropped.startswith("the engine refused its prompt")
    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))
    engine.refuse_over = 15
    [episodes] = run_all(runner(hint_env, engine, n=1), [("g", 0, {"prompt": "?", "answer": "1"})]).values()
    assert episodes[0].truncated and episodes[0].turns == 1


def test_a_first_prompt_that_leaves_no_room_to_answer_drops_the_episode_instead_of_sending_it_empty():
    """An empty response is rejected at the learner and its ticket given out again, for ever: such a prompt is
    dropped with its reason, as one the engine refuses."""
    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))
    r = runner(hint_env, engine, n=1)
    r.max_tokens = 5  # below the first prompt's length (its tools' schemas included)
    [episodes] = run_all(r, [("g", 0, {"prompt": "?", "answer": "1"})]).values()
    [episode] = episodes
    assert episode.dropped.startswith("its first prompt") and "leaves no room" in episode.dropped
    assert engine.budgets == []  # nothing was sent to the engine
    rollout = episode_rollout(episode, 1, None, EpisodeConfig(), "gen", 0.1)
    assert rollout.dropped == episode.dropped and rollout.problem() is None  # dropped with its reason, not rejected


def test_turns_sampled_with_other_stop_strings_get_their_own_sampling_parameters():
    """Evaluation's turns and training's share a length and temperature, not always their stop strings."""
    from generators.turns import VllmTurns

    class Backend:
        version = 0

        def __init__(self):
            self.added = []

        def sampling(self, params):
            return params

        def add(self, prompt_ids, sampling):
            self.added.append(sampling)
            return f"r{len(self.added)}"

    backend = Backend()
    turns = VllmTurns(backend)
    turns.add("eval", [1], SamplingParams(n=8, max_new_tokens=64, temperature=1.0, stop=()))
    turns.add("train", [1], SamplingParams(n=8, max_new_tokens=64, temperature=1.0, stop=("</answer>",)))
    assert [tuple(s.stop) for s in backend.added] == [(), ("</answer>",)]


def test_a_trl_style_environments_tools_come_from_its_methods():
    class Counter:
        def reset(self, **_):
            self.n = 0

        def bump(self) -> str:
            """Add one.

            Returns:
                The count.
            """
            self.n += 1
            return str(self.n)

        def get_reward(self) -> float:
            return float(self.n)

    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS] if CALL not in ids else [5, EOS], v))
    # the tiny model's one call token names "hint": an unknown tool here, answered with an error
    [episodes] = run_all(
        runner(lambda item: MethodsAsTools(Counter, item), engine, n=1), [("g", 0, {"prompt": "?"})]
    ).values()
    [episode] = episodes
    assert episode.metrics["tool_errors/unknown_tool"] == 1 and episode.reward == 0.0


def test_evaluation_runs_the_same_episodes_and_keeps_every_turn():
    from asyncrl.wire.protocol import EvalTicket
    from generators.evaluate import evaluate_episodes

    engine = ScriptedEngine(call_then_copy)
    r = runner(hint_env, engine, n=8)
    items = [{"prompt": "?", "answer": "583", "label": "583"}, {"prompt": "?", "answer": "120", "label": "120"}]
    ticket = EvalTicket(version=0, indices=[0, 1], k=3, temperature=1.0, max_new_tokens=4)
    try:
        traces = evaluate_episodes(r, ticket, items, reward_fn=lambda text, item: -1.0)
    finally:
        r.close()
    expected = [(0, False)] * 3 + [(0, True)] + [(1, False)] * 3 + [(1, True)]
    assert sorted((t.index, t.greedy) for t in traces) == expected
    greedy = next(t for t in traces if t.greedy and t.index == 0)
    assert greedy.reward == 1.0 and greedy.response == "583" and greedy.tool_calls == 1  # the environment's reward
    assert [m["role"] for m in greedy.turns] == ["user", "assistant", "tool", "assistant"]
    assert greedy.turns[2]["content"] == "583" and greedy.label == "583"


def test_evaluation_scores_a_truncated_episode_as_training_does_not_by_its_last_turn():
    from asyncrl.wire.protocol import EvalTicket
    from generators.evaluate import evaluate_episodes

    engine = ScriptedEngine(lambda key, ids, v: sample([CALL, EOS], v))  # calls the hint for ever
    r = runner(hint_env, engine, n=2, max_turns=2, truncated_reward=-0.5)
    ticket = EvalTicket(version=0, indices=[0], k=2, temperature=1.0, max_new_tokens=4)
    try:
        traces = evaluate_episodes(r, ticket, [{"prompt": "?", "answer": "583"}], reward_fn=lambda text, item: 1.0)
    finally:
        r.close()
    assert [t.reward for t in traces] == [-0.5] * 3 and not any(t.reward_failed for t in traces)


def test_a_first_turn_prefix_is_written_for_the_model_and_read_as_its_turn():
    seen = []

    def continue_the_call(key, ids, version):
        seen.append(ids)
        return sample([EOS], version) if CALL in ids else sample([5, EOS], version)

    engine = ScriptedEngine(continue_the_call)
    prefix = TOKENIZER.decode([CALL])
    r = runner(hint_env, engine, n=1, first_turn_prefix=prefix)
    [episodes] = run_all(r, [("g", 0, {"prompt": "?", "answer": "583"})]).values()
    [episode] = episodes
    assert seen[0][-1] == CALL  # the prompt ends with the prefix: the model continues the call
    assert episode.metrics["tool_calls"] == 1 and episode.turns == 2  # its first turn was read with the prefix
    assert episode.messages[1] == {"role": "assistant", "content": prefix}
    assert episode.ids[0] == EOS and episode.mask[0] == 1  # the prefix is prompt, not trained on


def test_tickets_taken_while_episodes_run_start_at_once_and_end_the_run_when_none_are_left():
    engine = ScriptedEngine(call_then_copy)
    more = [[("g1", 1, {"prompt": "?", "answer": "111"})], [("g2", 2, {"prompt": "?", "answer": "222"})]]
    asked = []

    def refill():
        asked.append(len(more))
        return more.pop(0) if more else []

    r = runner(hint_env, engine, n=4)
    try:
        order = [
            g
            for g, _ in r.run(
                [("g0", 0, {"prompt": "?", "answer": "000"})], lambda: None, refill=refill, refill_below=5
            )
        ]
    finally:
        r.close()
    assert sorted(order) == ["g0", "g1", "g2"]  # the refilled groups ran in the same run
    assert asked[:2] == [2, 1] and asked[-1] == 0  # asked while fewer than 5 episodes ran, until none were left
