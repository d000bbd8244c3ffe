"""Tool calls out of text: hermes tags and Llama 3 JSON, whole and fed in pieces."""

from __future__ import annotations

import json

import pytest

from pagedkv.server.tool_parsers import ToolCallExtractor, detect_tool_call_parser

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
)


def run(extractor: ToolCallExtractor, pieces: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for piece in pieces:
        text, new = extractor.feed(piece)
        content, calls = content + text, calls + new
    text, new = extractor.finish()
    return content + text, calls + new


@pytest.mark.parametrize("size", [1, 3, 7, len(HERMES)])
def test_hermes_calls_from_text_in_any_pieces(size: int) -> None:
    pieces = [HERMES[i : i + size] for i in range(0, len(HERMES), size)]
    content, calls = run(ToolCallExtractor("hermes"), pieces)
    assert content == "Let me check.\n\n"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_time", {"zone": "UTC"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_hermes_holds_back_only_a_possible_tag() -> None:
    extractor = ToolCallExtractor("hermes")
    assert extractor.feed("a < b <tool") == ("a < b ", [])
    assert extractor.feed("s>") == ("<tools>", [])
    # A tag never closed, or a body that is not a call, stays content.
    assert run(ToolCallExtractor("hermes"), ["x <tool_call>{bad"]) == ("x <tool_call>{bad", [])
    text = "<tool_call>[1]</tool_call>"
    assert run(ToolCallExtractor("hermes"), [text]) == (text, [])


def test_llama3_json_calls_and_plain_text() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    content, calls = run(ToolCallExtractor("llama3_json"), [text[:9], text[9:]])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert run(ToolCallExtractor("llama3_json"), ["Hello {there}"]) == ("Hello {there}", [])


def test_required_and_named() -> None:
    text = '[{"name": "f", "parameters": {"a": 1}}]'
    content, calls = run(ToolCallExtractor("required"), [text])
    assert content == "" and (calls[0].name, calls[0].arguments) == ("f", '{"a": 1}')
    extractor = ToolCallExtractor("named", "f")
    first, rest = extractor.feed('{"a"'), extractor.feed(": 1}")
    assert first[1][0].name == "f" and first[1][0].id.startswith("call_")
    assert "".join(d.arguments for d in first[1] + rest[1]) == '{"a": 1}'
    assert rest[1][0].id is None and extractor.num_calls == 1


def test_parser_detected_from_the_template() -> None:
    assert detect_tool_call_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_call_parser("{{ messages }}") is None
    assert detect_tool_call_parser(None) is None
