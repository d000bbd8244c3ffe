"""Structured outputs and tool calls through the `openai` client, on a tiny random Qwen2
with a Qwen2-style tokenizer whose chat template spells out hermes `<tool_call>` tags."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from helpers import make_chat_tokenizer, make_hf_model
from live_server import MODEL_NAME, start_server
from pydantic import BaseModel, Field

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Forces the model into the hermes format, so "auto" is tested on real generated text.
HERMES_GRAMMAR = (
    'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": '
    '\\"" [A-Z] [a-z]{1,6} "\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"'
)


class Toy(BaseModel):
    kind: Literal["ball", "rope"]
    squeaks: bool


class Pet(BaseModel):  # nested models: the schema refers to $defs
    kind: Literal["cat", "dog", "fox"]
    age: int = Field(ge=0, le=30)
    toys: list[Toy] = Field(max_length=2)
    favourite: Toy | None


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = make_hf_model(tmp_path_factory.mktemp("tools"), "qwen2", seed=3)
    make_chat_tokenizer(model_dir, "qwen2")
    with start_server(model_dir, num_blocks=1024, max_num_seqs=16) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def test_parse_returns_the_pydantic_object(client) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Pet, seed=seed, max_tokens=300
        )
        message = completion.choices[0].message
        assert isinstance(message.parsed, Pet), message.content
        assert Pet.model_validate_json(message.content) == message.parsed


def test_json_object_and_structured_outputs_on_completions(client) -> None:
    for extra, check in [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}},
         lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ]:  # fmt: skip
        result = client.completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=150, seed=2, n=2, extra_body=extra
        )
        for choice in result.choices:
            assert choice.finish_reason == "stop" and check(choice.text), choice.text


def test_json_schema_on_chat_streams_valid_json(client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    stream = chat(client, response_format=response_format, seed=4, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), WEATHER)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
         "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_it(client, kwargs, field) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert f"400 - {field}: " in info.value.message


def _validate_calls(tool_calls, names) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[dict[int, dict], list[str | None]]:
    """Tool calls joined from stream deltas, checking OpenAI's delta shape on the way."""
    calls: dict[int, dict] = {}
    finish = []
    for chunk in stream:
        for choice in chunk.choices:
            finish.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:  # the first piece opens the call
                    assert piece.id.startswith("call_") and piece.type == "function"
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    return calls, finish


def test_named_tool_choice(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    result = chat(client, tools=TOOLS, tool_choice=named, seed=5)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _validate_calls(choice.message.tool_calls, {"get_weather"})
    calls, finish = _streamed_calls(chat(client, tools=TOOLS, tool_choice=named, seed=5,
                                         stream=True))  # fmt: skip
    assert finish[-1] == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_required_tool_choice(client) -> None:
    for seed in range(3):
        result = chat(client, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=200)
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        _validate_calls(choice.message.tool_calls, set(SCHEMAS))
    calls, finish = _streamed_calls(
        chat(client, tools=TOOLS, tool_choice="required", seed=1, max_tokens=200, stream=True)
    )
    assert finish[-1] == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_reads_hermes_tool_calls_from_the_output(client) -> None:
    forced = {"structured_outputs": {"grammar": HERMES_GRAMMAR}}
    result = chat(client, tools=TOOLS, seed=6, extra_body=forced)  # "auto" is the default
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _validate_calls(choice.message.tool_calls, {"get_weather"})
    stream = chat(client, tools=TOOLS, tool_choice="auto", seed=6, extra_body=forced, stream=True)
    calls, finish = _streamed_calls(stream)
    assert finish[-1] == "tool_calls"
    assert calls == {0: {"name": "get_weather",
                         "arguments": choice.message.tool_calls[0].function.arguments}}  # fmt: skip


def test_auto_without_a_call_is_plain_content(client) -> None:
    forced = {"structured_outputs": {"choice": ["It is sunny."]}}
    result = chat(client, tools=TOOLS, seed=6, extra_body=forced)
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "It is sunny."
    assert not choice.message.tool_calls


@pytest.fixture(scope="module")
def llama_client(tmp_path_factory):
    model_dir = make_hf_model(tmp_path_factory.mktemp("llama-tools"), "llama", seed=3)
    make_chat_tokenizer(model_dir, "llama3")
    with start_server(model_dir, num_blocks=1024, tool_call_parser="llama3_json") as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_auto_reads_llama3_json_tool_calls(llama_client) -> None:
    grammar = (
        'root ::= "{\\"name\\": \\"get_time\\", \\"parameters\\": {\\"zone\\": \\"" '
        '("UTC" | "CET") "\\"}}"'
    )
    forced = {"structured_outputs": {"grammar": grammar}}
    # One small tool: the template spells tools out at length, in a 1024-token context.
    result = chat(llama_client, tools=TOOLS[1:], tool_choice="auto", seed=2, extra_body=forced)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _validate_calls(choice.message.tool_calls, {"get_time"})
    calls, finish = _streamed_calls(
        chat(llama_client, tools=TOOLS[1:], seed=2, extra_body=forced, stream=True)
    )
    assert finish[-1] == "tool_calls" and calls[0]["name"] == "get_time"
    plain = chat(llama_client, tools=TOOLS[1:], seed=2,
                 extra_body={"structured_outputs": {"regex": "[a-z]{1,8}"}})  # fmt: skip
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
