"""Environments and tools: calls read from the model's text, every failure an error message, and conversations
rendered token-exactly through real chat templates."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from conftest import ROOT
from transformers import AutoTokenizer

from asyncrl.config import TaskConfig
from asyncrl.envs import check_environment, environment_factory
from asyncrl.envs.base import Turn
from asyncrl.envs.chat import ChatRenderer, with_tools_in_system_prompt
from asyncrl.envs.hint import HintEnv
from asyncrl.envs.tool_env import MethodsAsTools, ToolEnvironment
from asyncrl.envs.tools import BadCall, Toolbox, ToolCall, parse_tool_calls

SMOLLM2 = ROOT / "models/smollm2-135m"


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def fail(reason: str) -> str:
    """Raise with a reason.

    Args:
        reason: What to say.
    """
    raise RuntimeError(reason)


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def fetch(url: str) -> str:
    """Fetch a page.

    Args:
        url: Where.
    """
    await asyncio.sleep(0)
    return f"page of {url}"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_calls_are_read_in_order_and_a_bad_one_is_kept_as_bad():
    text = f"Let me see. {call('add', a=1, b=2)} and {call('fetch', url='x')} <tool_call>{{nope</tool_call>"
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("fetch", {"url": "x"})]
    assert isinstance(calls[2], BadCall) and "not valid JSON" in calls[2].reason
    assert parse_tool_calls("The answer is 4.") == []


def test_a_call_left_open_by_a_turn_cut_short_is_malformed():
    good, bad = parse_tool_calls(call("add", a=1, b=2) + ' then <tool_call>{"name": "add", "argu')
    assert good == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(bad, BadCall) and "never closed" in bad.reason


def test_a_call_ends_where_its_json_does_and_strings_may_hold_newlines_and_the_tags():
    code = "x = 1\nprint('</tool_call>')"
    raw = '<tool_call>{"name": "run", "arguments": {"code": "' + code.replace("'", "'") + '"}}</tool_call>'
    [run] = parse_tool_calls(raw + " The <tool_call> above ran it.")  # prose naming the tag is no call
    assert run == ToolCall("run", {"code": code})  # a raw newline in a string, as models write code
    [cut] = parse_tool_calls('Use <tool_call> tags. <tool_call>{"name": "add", "argu')  # prose, then cut short
    assert isinstance(cut, BadCall) and "never closed" in cut.reason
    assert parse_tool_calls("the <tool_call> tag: " + call("add", a=1, b=2)) == [ToolCall("add", {"a": 1, "b": 2})]
    [deep] = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 1000 + "</tool_call>")
    assert isinstance(deep, BadCall) and "not valid JSON" in deep.reason  # not a RecursionError


def lookup(key: str, limit: int | None = None) -> str:
    """Look a key up.

    Args:
        key: What to look up.
        limit: At most this many.
    """
    return f"{key}:{limit}"


def quits(flag: str) -> str:
    """Parse a flag the way argparse does on bad input.

    Args:
        flag: The flag.
    """
    raise SystemExit(2)


def test_null_for_an_optional_argument_is_accepted_and_a_tool_that_exits_is_an_error():
    toolbox = Toolbox([lookup, quits])
    [result] = [asyncio.run(toolbox.call(c)) for c in parse_tool_calls(call("lookup", key="a", limit=None))]
    assert (result.content, result.error) == ("a:None", None)
    [result] = [asyncio.run(toolbox.call(c)) for c in parse_tool_calls(call("quits", flag="-x"))]
    assert result.error == "tool_exception" and "SystemExit" in result.content


def test_arguments_written_as_a_json_string_are_read():
    [good] = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    assert good == ToolCall("add", {"a": 1, "b": 2})


@pytest.mark.parametrize(
    ("text", "kind", "says"),
    [
        ("<tool_call>{nope</tool_call>", "malformed_call", "not valid JSON"),
        (call("multiply", a=1), "unknown_tool", "no tool named 'multiply'"),
        (call("add", a=1), "bad_arguments", "missing a required argument: 'b'"),
        (call("add", a=1, b="two"), "bad_arguments", "b must be of type integer"),
        (call("add", a=1, b=2, c=3), "bad_arguments", "unexpected keyword argument 'c'"),
        (call("fail", reason="disk full"), "tool_exception", "RuntimeError: disk full"),
        (call("hang", seconds=30), "tool_timeout", "did not finish within 0.2 s"),
    ],
)
def test_every_failed_call_is_an_error_message_of_its_kind(text, kind, says):
    toolbox = Toolbox([add, fail, hang, fetch], timeout_s=0.2)
    [result] = [asyncio.run(toolbox.call(c)) for c in parse_tool_calls(text)]
    assert result.error == kind
    assert result.content.startswith("Error") and says in result.content


def test_sync_and_async_tools_answer():
    toolbox = Toolbox([add, fetch])
    results = [asyncio.run(toolbox.call(c)) for c in parse_tool_calls(call("add", a=2, b=3) + call("fetch", url="u"))]
    assert [(r.content, r.error) for r in results] == [("5", None), ("page of u", None)]


def test_a_tool_without_a_docstring_is_refused_naming_it():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="tool 'bare' needs type hints"):
        Toolbox([bare])


def test_the_tools_environment_answers_calls_then_ends_on_a_turn_without_one():
    env = ToolEnvironment({"prompt": "What is 2 + 3?"}, Toolbox([add]), system_prompt="Be brief.")
    observation = env.reset()
    assert observation.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert observation.tools == [add]
    text = call("add", a=2, b=3)
    feedback = asyncio.run(env.step(Turn(text, parse_tool_calls(text), "stop", 0)))
    assert feedback.messages == [{"role": "tool", "name": "add", "content": "5"}] and not feedback.done
    assert feedback.metrics["tool_calls"] == 1
    final = asyncio.run(env.step(Turn("5", [], "stop", 1)))
    assert final.done and final.reward is None  # the task's reward scores it


def test_a_worked_example_goes_between_the_system_prompt_and_every_question():
    example = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": call("add", a=1, b=1)},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    task = TaskConfig(
        tools=["asyncrl.envs.calculator:calculator"], system_prompt="Be brief.", env_args={"examples": example}
    )
    env = environment_factory(task, tool_timeout_s=1.0)({"prompt": "What is 2 + 3?"})
    messages = env.reset().messages
    assert messages == [
        {"role": "system", "content": "Be brief."},
        *example,
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    # a conversation prompt with its own system message keeps it first
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
    assert environment_factory(task, tool_timeout_s=1.0)({"prompt": own}).reset().messages == [own[0], *example, own[1]]


class Wordle:
    """A TRL-style environment: made without arguments, reset with the row, public methods as tools."""

    def reset(self, secret: str, **_) -> str:
        self.secret, self.tries = secret, 0
        return " You have 3 tries."

    def guess(self, word: str) -> str:
        """Guess the word.

        Args:
            word: A five-letter word.
        """
        self.tries += 1
        return "right" if word == self.secret else "wrong"

    def get_reward(self) -> float:
        return 1.0 / self.tries if self.tries else 0.0


def test_a_trl_style_class_runs_unchanged():
    task = TaskConfig(env="test_envs:Wordle")
    make = environment_factory(task, tool_timeout_s=5.0)
    env = make({"prompt": "Guess my word.", "secret": "crane", "row": 7})
    assert isinstance(env, MethodsAsTools)
    observation = asyncio.run(env.reset())
    assert observation.messages == [{"role": "user", "content": "Guess my word. You have 3 tries."}]
    assert [tool.__name__ for tool in observation.tools] == ["guess"]
    for word in ("slate", "crane"):
        text = call("guess", word=word)
        asyncio.run(env.step(Turn(text, parse_tool_calls(text), "stop", 0)))
    final = asyncio.run(env.step(Turn("done", [], "stop", 2)))
    assert final.done and final.reward == 0.5


def test_the_hint_environment_pays_only_after_the_hint():
    make = environment_factory(TaskConfig(env="hint"), tool_timeout_s=5.0)
    env = make({"prompt": "?", "answer": "583"})
    assert isinstance(env, HintEnv)
    asyncio.run(env.reset())
    guessed = asyncio.run(env.step(Turn("583", [], "stop", 0)))
    assert guessed.done and guessed.reward == 0.0  # right, but a guess
    env = make({"prompt": "?", "answer": "583"})
    asyncio.run(env.reset())
    text = call("hint")
    told = asyncio.run(env.step(Turn(text, parse_tool_calls(text), "stop", 0)))
    assert told.messages[0]["content"] == "583"
    assert asyncio.run(env.step(Turn("583", [], "stop", 1))).reward == 1.0


@pytest.mark.parametrize(
    ("task", "says"),
    [
        (TaskConfig(env="nowhere_module:Env"), "task.env: cannot import"),
        (TaskConfig(env="mystery"), "task.env: unknown name 'mystery'"),
        (TaskConfig(tools=["calculator", "abacus"]), "task.tools: unknown name 'abacus'"),
        (TaskConfig(tools=["asyncrl.envs.tools:nothing_here"]), "task.tools: cannot import"),
        (TaskConfig(tools=["calculator"], env_args={"example": []}), r"task.env_args: .* only 'examples'"),
        (
            TaskConfig(tools=["calculator"], env_args={"examples": [{"role": "robot", "content": "hi"}]}),
            r"task.env_args.examples\[0\]: a message whose role",
        ),
        (
            TaskConfig(tools=["calculator"], env_args={"examples": [{"role": "user", "content": 3}]}),
            r"task.env_args.examples\[0\].content: text",
        ),
    ],
)
def test_a_missing_environment_or_tool_fails_in_one_line_naming_the_key(task, says):
    with pytest.raises(ValueError, match=says):
        check_environment(task)


def _agent_tokenizer():
    return AutoTokenizer.from_pretrained(ROOT / "assets/tiny-agent")


def _exact(tokenizer, renderer: ChatRenderer, schemas, turns: list[str], replies: list[list[dict]]):
    """Assemble a conversation turn by turn as episodes do; return it and the template's own rendering."""
    messages = [{"role": "user", "content": "Question?"}]
    ids = renderer.prompt(messages, schemas)
    for i, text in enumerate(turns):
        sampled = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids += sampled
        if i < len(replies):
            ids += renderer.reply(messages, sampled, replies[i], schemas)
            messages += [{"role": "assistant", "content": text}, *replies[i]]
        else:
            messages.append({"role": "assistant", "content": text})
    shown = with_tools_in_system_prompt(messages, schemas) if renderer.tool_format == "system_prompt" else messages
    kwargs = {"tools": schemas} if renderer.tool_format == "template" and schemas else {}
    whole = tokenizer.apply_chat_template(shown, tokenize=False, **kwargs)
    return ids, tokenizer.encode(whole, add_special_tokens=False)


def test_an_episode_is_the_chat_templates_own_tokens_turn_by_turn():
    tokenizer = _agent_tokenizer()
    renderer = ChatRenderer(tokenizer, "template")
    ids, whole = _exact(tokenizer, renderer, [], [call("hint"), "583"], [[{"role": "tool", "content": "583"}]])
    assert ids == whole[: len(ids)] and tokenizer.decode(whole[len(ids) :]) == "\n"  # the template's last newline


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="asyncrl model import smollm2-135m first")
def test_smollm2s_chatml_gets_the_tools_in_its_system_prompt_and_stays_token_exact():
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    renderer = ChatRenderer(tokenizer)
    assert renderer.tool_format == "system_prompt"  # its template has no tools section
    schemas = Toolbox([add]).schemas
    turns = [call("add", a=12, b=30), call("add", a=42, b=1), "The answer is 43."]
    replies = [[{"role": "tool", "content": "42"}], [{"role": "tool", "content": "43"}]]
    ids, whole = _exact(tokenizer, renderer, schemas, turns, replies)
    assert ids == whole[: len(ids)] and len(whole) - len(ids) == 1
    assert '"name": "add"' in tokenizer.decode(ids[:200])  # the schema is in the prompt


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="asyncrl model import smollm2-135m first")
def test_a_template_with_a_tools_section_renders_the_tools_itself():
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    tokenizer.chat_template = QWEN_LIKE
    renderer = ChatRenderer(tokenizer)
    assert renderer.tool_format == "template"
    schemas = Toolbox([add]).schemas
    replies = [[{"role": "tool", "content": "42"}]]
    ids, whole = _exact(tokenizer, renderer, schemas, [call("add", a=12, b=30), "42"], replies)
    assert ids == whole[: len(ids)]
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(ids)


class CharTokenizer:
    """One token per character, and ``<|im_end|>`` as one special token (id 0): ChatML, as SmolLM2 renders it."""

    END = "<|im_end|>"
    chat_template = "ChatML"

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            special = text.startswith(self.END, i)
            ids.append(0 if special else ord(text[i]))
            i += len(self.END) if special else 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.END if i == 0 else chr(i) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}{self.END}\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_a_turn_cut_off_on_a_token_that_reads_like_the_turn_ending_still_gets_its_special_token():
    tokenizer = CharTokenizer()
    renderer = ChatRenderer(tokenizer, "system_prompt")
    history, new = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "go on"}]
    # cut off at max_new_tokens on "<": the ending follows whole, its special token first
    cut = renderer.reply(history, tokenizer.encode("if a<"), new, [])
    assert cut[0] == 0 and tokenizer.decode(cut).startswith(tokenizer.END + "\n<|im_start|>user")
    # a turn that sampled the ending's token is followed by the rest of the ending only
    ended = renderer.reply(history, tokenizer.encode("done") + [0], new, [])
    assert tokenizer.decode(ended).startswith("\n<|im_start|>user") and 0 not in ended[:1]


def test_a_template_that_rewrites_history_is_refused_rather_than_misaligned():
    tokenizer = _agent_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last or m.role != 'assistant' %}{{ m.role }}:{{ m.content }}\n"
        "{% endif %}{% endfor %}"
    )
    renderer = ChatRenderer(tokenizer, "template")
    with pytest.raises(ValueError, match="renders earlier messages differently"):
        renderer.reply([{"role": "user", "content": "1"}], [5], [{"role": "tool", "content": "2"}], [])


def test_a_model_without_a_chat_template_is_refused_naming_task_env():
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny-llama")
    with pytest.raises(ValueError, match="task.env: multi-turn episodes need a chat template"):
        ChatRenderer(tokenizer)


def test_the_tiny_agent_model_is_what_its_builder_writes(tmp_path: Path):
    from asyncrl.launch.tiny_model import build

    built = build(tmp_path / "agent", agent=True)
    for name in ("tokenizer.json", "config.json"):
        assert json.loads((built / name).read_text()) == json.loads((ROOT / "assets/tiny-agent" / name).read_text())
