"""Tool calls out of generated text, whole or as it streams.

A `ToolCallExtractor` splits one choice's text into content and OpenAI tool calls. `feed`
takes each new piece of text and returns what can be sent now; `finish` flushes the rest.
The formats:

- **named** (`tool_choice` names a function): the whole text is that function's arguments
  (constrained to its schema); streamed as argument deltas.
- **required**: the text is a JSON list of ``{"name", "parameters"}`` (constrained to the
  tools' schemas); sent when complete.
- **hermes** (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks among the content.
- **llama3_json** (Llama 3.x): the whole text is ``{"name", "parameters"}`` (several joined
  by ``;``), possibly after ``<|python_tag|>``; any other text is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCallExtractor:
    """Content and tool calls of one choice (see the module docstring for `mode`)."""

    mode: str
    function_name: str | None = None  # the named function, mode "named"
    _buffer: str = ""
    _num_calls: int = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New text in; (content to send now, tool-call deltas to send now) out."""
        if self.mode == "named":
            deltas = [] if self._num_calls else [self._new_call(self.function_name or "", "")]
            if text:
                deltas.append(ToolCallDelta(0, arguments=text))
            return "", deltas
        self._buffer += text
        if self.mode == "hermes":
            return self._feed_hermes()
        return "", []  # required, llama3_json: the whole text decides

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the text: everything still held."""
        text, self._buffer = self._buffer, ""
        calls = None
        if self.mode == "required":
            calls = _parse_calls(text, "parameters", is_list=True)
        elif self.mode == "llama3_json":
            body = text.strip().removeprefix(_PYTHON_TAG).strip()
            calls = _parse_calls(body, "parameters", is_list=False) if body[:1] == "{" else None
        if calls is None:  # hermes: an unclosed <tool_call> stays content
            return text, []
        self._num_calls += len(calls)
        return "", calls

    def _feed_hermes(self) -> tuple[str, list[ToolCallDelta]]:
        content, calls = [], []
        while True:
            start = self._buffer.find(_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, _OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            end = self._buffer.find(_CLOSE, start)
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            body = self._buffer[start + len(_OPEN) : end]
            parsed = _parse_calls(body.strip(), "arguments", is_list=False, first=self._num_calls)
            if parsed is None:
                content.append(self._buffer[: end + len(_CLOSE)])
            else:
                content.append(self._buffer[:start])
                calls += parsed
                self._num_calls += len(parsed)
            self._buffer = self._buffer[end + len(_CLOSE) :]
        return "".join(content), calls

    def _new_call(self, name: str, arguments: str) -> ToolCallDelta:
        self._num_calls += 1
        return ToolCallDelta(self._num_calls - 1, tool_call_id(), name, arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may open it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _parse_calls(
    text: str, arguments_key: str, *, is_list: bool, first: int = 0
) -> list[ToolCallDelta] | None:
    """Tool calls from JSON text: one object, a list (`is_list`), or for llama3 objects
    joined by ";". None when the text is not such JSON."""
    try:
        values = (
            json.loads(text)
            if is_list or arguments_key == "arguments"
            else [json.loads(part) for part in text.split(";") if part.strip()]
        )
    except json.JSONDecodeError:
        return None
    if isinstance(values, dict):
        values = [values]
    if not isinstance(values, list) or not values:
        return None
    calls = []
    for i, value in enumerate(values):
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments: Any = value.get(arguments_key, value.get("arguments", {}))
        calls.append(ToolCallDelta(first + i, tool_call_id(), value["name"], json.dumps(arguments)))
    return calls


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies, where it is unambiguous: one that spells out
    ``<tool_call>`` is hermes; None otherwise."""
    if chat_template and _OPEN in chat_template:
        return "hermes"
    return None
