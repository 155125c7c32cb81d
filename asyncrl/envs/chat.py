"""Token-exact conversations: the prompt's tokens, then each turn as the model sampled it, then each reply as
the chat template renders it.

The model's tokens are never decoded and encoded again (a round trip can
merge or split tokens, and the learner would then train on a sequence the
model never sampled). What the environment says is appended as the tokens
the chat template adds for it: the conversation is rendered with and without
the new messages, after an assistant turn whose content is a sentinel, and
the difference is encoded. Whatever the template closes an assistant turn
with that the model did not sample itself (its end-of-turn token after a
turn cut short, the newline after it) comes first, also as the
environment's tokens.

Tools reach the model through the template's own tools section (``tools=``,
as Qwen's, Llama's and Hermes templates have). A template without one
(SmolLM2's ChatML) gets the tools' schemas in the system prompt in the same
Hermes form instead; ``episode.tool_format`` picks either by hand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from asyncrl.envs.base import Message

SENTINEL = "\u2063asyncrl-turn\u2063"  # an assistant turn's content while the template's frame is measured
ToolFormat = Literal["auto", "template", "system_prompt"]


def hermes_tools_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """The tools as a system prompt in the Hermes form: their schemas, and how to call one."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return (
        "You can call tools to help answer. The tools, as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a tool, write its name and arguments as a JSON object between tags:\n"
        '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n</tool_call>\n'
        "Its result comes back in the next message. Without a tool call, your message is the final answer."
    )


class ChatRenderer:
    """Renders one conversation's messages into token ids through the model's chat template."""

    def __init__(self, tokenizer: Any, tool_format: ToolFormat = "auto", **template_kwargs: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.env: multi-turn episodes need a chat template, and the model's tokenizer has none "
                "(set tokenizer_config.json's chat_template, or save one as chat_template.jinja in the model folder)"
            )
        self.tokenizer = tokenizer
        self.kwargs = template_kwargs
        if tool_format == "auto":
            tool_format = "template" if self._template_shows_tools() else "system_prompt"
        self.tool_format = tool_format

    def prompt(self, messages: list[Message], schemas: Sequence[dict[str, Any]]) -> list[int]:
        """The first prompt's token ids, the generation prompt included."""
        return self.encode(self._render(messages, schemas, generation_prompt=True))

    def reply(
        self, history: list[Message], model_ids: Sequence[int], new: list[Message], schemas: Sequence[dict[str, Any]]
    ) -> list[int]:
        """The tokens that follow the model's turn ``model_ids`` (``history`` ends before it) when ``new``
        messages come next, up to and including the next generation prompt."""
        turn = {"role": "assistant", "content": SENTINEL}
        before = self._render([*history, turn], schemas, generation_prompt=False)
        after = self._render([*history, turn, *new], schemas, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders earlier messages differently once new ones follow, so a reply "
                "cannot be appended token-exactly; use a template that renders history unchanged"
            )
        closing = before[before.rindex(SENTINEL) + len(SENTINEL) :]  # what ends an assistant turn
        return self.encode(self._unsampled(closing, model_ids) + after[len(before) :])

    def _unsampled(self, closing: str, model_ids: Sequence[int]) -> str:
        """The part of the template's turn ending that the model's tokens do not already end with: the first
        token of the ending (say ``<|im_end|>``) when the model sampled that very token. A turn cut off on a
        token that merely reads like the ending's start (``<``) has not ended it: the whole ending follows, so
        the model sees its special token, not its text spelled out."""
        closing_ids = self.encode(closing)
        if model_ids and closing_ids and model_ids[-1] == closing_ids[0]:
            sampled = self.tokenizer.decode(closing_ids[:1], skip_special_tokens=False)
            if closing.startswith(sampled):
                return closing[len(sampled) :]
        return closing

    def _render(self, messages: list[Message], schemas: Sequence[dict[str, Any]], generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = dict(self.kwargs)
        if schemas and self.tool_format == "template":
            kwargs["tools"] = list(schemas)
        elif schemas:
            messages = with_tools_in_system_prompt(messages, schemas)
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, without special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _template_shows_tools(self) -> bool:
        """Whether the template renders ``tools=``: a probe tool's name shows up in its output."""
        probe = {
            "type": "function",
            "function": {"name": "asyncrl_probe_tool", "description": "probe", "parameters": {"type": "object"}},
        }
        messages = [{"role": "user", "content": "hi"}]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=[probe], tokenize=False, **self.kwargs)
        except Exception:  # noqa: BLE001  (a template that cannot take tools: the fallback serves it)
            return False
        return "asyncrl_probe_tool" in text


def with_tools_in_system_prompt(messages: list[Message], schemas: Sequence[dict[str, Any]]) -> list[Message]:
    """``messages`` with the tools' Hermes prompt leading the system message (one is added where none is)."""
    tools = hermes_tools_prompt(schemas)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{tools}"}, *messages[1:]]
    return [{"role": "system", "content": tools}, *messages]
