"""The grammar compiler on a small vocabulary: what each constraint's grammar accepts,
its cache, and its error messages."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.compiler import StructuredOutputCompiler


@pytest.fixture(scope="module")
def compiler() -> StructuredOutputCompiler:
    return StructuredOutputCompiler(xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2]))


def accepts(compiler: StructuredOutputCompiler, params: StructuredOutputsParams, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile(params))
    return matcher.accept_string(text.encode()) and matcher.is_completed()


def test_choice_takes_any_string(compiler) -> None:
    choices = ["café ☕", 'say "hi"\n', "back\\slash", "😀"]
    params = StructuredOutputsParams(choice=choices)
    assert all(accepts(compiler, params, c) for c in choices)
    assert not accepts(compiler, params, "cafe")


def test_bounded_json_strings_hold_to_json_and_utf8(compiler) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"]}  # fmt: skip
    params = StructuredOutputsParams(json=schema)
    assert accepts(compiler, params, '{"s": "ab☕"}')
    assert not accepts(compiler, params, '{"s": "a\x01"}')  # a raw control character
    matcher = xgr.GrammarMatcher(compiler.compile(params))
    assert not matcher.accept_string(b'{"s": "\xed\xa0\x80')  # a UTF-16 surrogate


def test_one_compile_per_constraint(compiler) -> None:
    before = compiler.num_grammars
    first = compiler.submit(StructuredOutputsParams(regex="x+"))
    assert compiler.submit(StructuredOutputsParams(regex="x+")) is first
    assert compiler.num_grammars == before + 1


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(json={"type": "objectx"}),
         r'^structured_outputs.json: invalid JSON schema: Unsupported type "objectx"$'),
        (StructuredOutputsParams(grammar="root ::= foo"),
         r"^structured_outputs.grammar: invalid EBNF grammar: .*foo"),
    ],
)  # fmt: skip
def test_errors_name_the_field_without_source_locations(compiler, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(params)
