"""Tool calls in a model turn, read in the model's own tool-calling format.

A tokenizer whose chat template ships a response schema (``tokenizer.response_schema``, read by
``tokenizer.parse_response``) is parsed with it. Otherwise the turn is read in the Hermes format, which the
templates of Qwen2.5, Qwen3, SmolLM3 and Hermes render and which TRL's environments use: each call is a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block. A block that is not that JSON is a malformed
call: it is returned with its error, so the environment can tell the model what was wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""One call in the Hermes format; group 1 is its JSON."""


@dataclass
class ToolCall:
    """One call the model made: the tool's ``name`` and its ``arguments``, or the ``error`` that made it
    unreadable (then ``name`` may be empty)."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None

    def message(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (the chat templates' format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _hermes(text: str) -> list[ToolCall]:
    calls = []
    for block in HERMES.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", error=f"the tool call is not JSON ({err.msg} at character {err.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall("", error='a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(data["name"], error="the arguments of a tool call are a JSON object"))
            continue
        calls.append(ToolCall(data["name"], args))
    return calls


def parse_tool_calls(text: str, tokenizer=None, tools: list[dict] | None = None) -> list[ToolCall]:
    """The tool calls in a model turn's ``text``, in order (empty: the turn calls no tool).

    With a ``tokenizer`` that has a ``response_schema``, its ``parse_response`` reads them (``tools``, the JSON
    schemas, cast the arguments to their types); otherwise the Hermes ``<tool_call>`` blocks are read."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        try:
            parsed = tokenizer.parse_response(text, tools=tools)
        except Exception as err:  # noqa: BLE001 - the template's own parser refused the turn
            return [ToolCall("", error=f"the tool call could not be read: {' '.join(str(err).split())[:200]}")]
        calls = []
        for call in (parsed or {}).get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    calls.append(ToolCall(str(fn.get("name", "")), error="the arguments are not a JSON object"))
                    continue
            calls.append(ToolCall(str(fn.get("name", "")), dict(args)))
        return calls
    return _hermes(text)
