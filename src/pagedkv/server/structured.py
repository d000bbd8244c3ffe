"""A request body's constraint and tool-call format: `response_format`, vLLM's
`structured_outputs`, and `tools` with `tool_choice`, turned into one
`StructuredOutputsParams` and a `ToolCallExtractor` factory; the compile is awaited here,
off the engine's thread, so a bad constraint is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.server.serving import APIError, ServerState
from pagedkv.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    ToolCallExtractor,
    detect_tool_call_parser,
)

ExtractorFactory = Callable[[], ToolCallExtractor]
# A constraint and the request field it came from (named in its errors).
Found = tuple[StructuredOutputsParams, str]


def request_constraint(body: Any) -> list[Found]:
    """The constraints of `structured_outputs` and `response_format`.

    Raises:
        APIError: a malformed constraint (400 naming the field).
    """
    found: list[Found] = []
    field = "structured_outputs"
    try:
        if body.structured_outputs is not None:
            constraint = StructuredOutputsParams.from_dict(body.structured_outputs)
            found.append((constraint, field))
        response_format, field = body.response_format, "response_format.json_schema.schema"
        if response_format is not None and response_format.type == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif response_format is not None and response_format.type == "json_schema":
            schema = response_format.json_schema.schema_
            found.append((StructuredOutputsParams(json=schema), field))
    except ValueError as exc:
        raise APIError(_renamed(str(exc), field), param=field, reason="schema") from None
    return found


async def constrain(state: ServerState, found: list[Found]) -> StructuredOutputsParams | None:
    """The one constraint of a request, compiled: waits (without blocking the event loop or
    the engine) for its grammar, so that a bad one is a 400 here.

    Raises:
        APIError: two constraints, a constraint that does not compile, or a model without a
            tokenizer (400 naming the field).
    """
    if not found:
        return None
    if len(found) > 1:
        fields = ", ".join(f for _, f in found)
        raise APIError(f"{fields}: expected at most one constraint, got {len(found)}",
                       param=found[0][1])  # fmt: skip
    constraint, field = found[0]
    try:
        compiler = state.engine.engine.structured_outputs.compiler
        await asyncio.wrap_future(compiler.submit(constraint))
    except ValueError as exc:
        raise APIError(_renamed(str(exc), field), param=field, reason="schema") from None
    return constraint


def _renamed(message: str, field: str) -> str:
    """An engine message ("structured_outputs.json: ...") under the request's field."""
    head, _, rest = message.partition(": ")
    return message if head.startswith(field) or not rest else f"{field}: {rest}"


def tool_constraint(
    body: Any, parser: str | None, chat_template: str | None
) -> tuple[list[Found], ExtractorFactory | None]:
    """The constraint and the extractor factory of a chat body's `tools` and `tool_choice`.

    "none" (or no tools): neither. A named function: its arguments' schema. "required": a
    list of calls, each one of the tools with its schema. "auto": no constraint, and the
    parser of `--tool-call-parser` or the one the chat template implies.

    Raises:
        APIError: "auto" with no parser for the model's format, a named function that is not
            among `tools`, or tool_choice without tools (400).
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(
                f'tool_choice: expected "none" or none without tools, got {choice!r:.60}',
                param="tool_choice",
            )
        return [], None
    functions = {t.function.name: t.function for t in body.tools}
    choice = "auto" if choice is None else choice
    if choice == "none":
        return [], None
    if choice == "auto":
        mode = parser or detect_tool_call_parser(chat_template)
        if mode is None:
            raise APIError(
                'tool_choice: "auto" needs a tool-call format: start the server with '
                f"--tool-call-parser {{{','.join(TOOL_CALL_PARSERS)}}} (the chat template names "
                "none)",
                param="tool_choice",
            )
        return [], lambda: ToolCallExtractor(mode)
    if choice == "required":
        items = [_call_schema(name, f.parameters) for name, f in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return [(StructuredOutputsParams(json=schema), "tools")], lambda: ToolCallExtractor(
            "required"
        )
    assert not isinstance(choice, str), f"tool_choice {choice!r}: checked by the protocol"
    name = choice.function.name
    if name not in functions:
        raise APIError(
            f"tool_choice.function.name: expected one of {sorted(functions)}, got {name!r:.60}",
            param="tool_choice",
        )
    schema = functions[name].parameters or {"type": "object"}
    return [(StructuredOutputsParams(json=schema), "tools")], lambda: ToolCallExtractor(
        "named", name
    )


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"enum": [name]}, "parameters": parameters or {"type": "object"}},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
