"""Structured outputs on tiny random models with Llama-3-style and Qwen2-style tokenizers:
every constrained completion parses and validates, through n > 1, preemption and swap."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers import make_chat_tokenizer, make_hf_model

from pagedkv import LLM, BeamSearchParams, LLMEngine, SamplingParams, StructuredOutputsParams
from pagedkv.cache import PagedKVCache
from pagedkv.config import ModelConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "address"],
    "additionalProperties": False,
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["The quick brown fox", "A paged KV cache", "hello", "def forward(self):"]
MAX_TOKENS = 200


def make_model(tmp_path_factory, style: str, arch: str) -> str:
    model_dir = make_hf_model(tmp_path_factory.mktemp(style), arch, seed=5)
    make_chat_tokenizer(model_dir, style)
    return str(model_dir)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory, "llama3", "llama")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory, "qwen2", "qwen2")


def make_llm(model_dir: str, num_blocks: int = 256, **kwargs) -> LLM:
    return LLM(
        model_dir, device="cpu", dtype="float32", block_size=8, num_blocks=num_blocks, **kwargs
    )


@pytest.fixture(scope="module")
def llama(llama_dir: str) -> LLM:
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def qwen(qwen_dir: str) -> LLM:
    return make_llm(qwen_dir)


def constrained(
    count: int, *, n: int = 1, schema: dict = SCHEMA, max_tokens: int = MAX_TOKENS, **kwargs
) -> list[SamplingParams]:
    """Seeded sampling (greedy decoding on a random model repeats a digit or a character
    forever inside a number or a string)."""
    so = StructuredOutputsParams(json=schema)
    return [
        SamplingParams(
            n=n, temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=so, **kwargs
        )
        for i in range(count)
    ]


def assert_valid(outputs, schema: dict = SCHEMA) -> None:
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)


def test_params_name_the_fields() -> None:
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json: not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="structured_outputs: expected StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("json", {"type": "objectx"}, r"structured_outputs.json: invalid JSON schema: .*objectx"),
        ("regex", "[a-", r"structured_outputs.regex: invalid regex: .*Unclosed"),
        ("grammar", "root ::= foo", r"structured_outputs.grammar: invalid EBNF .*foo"),
    ],
)
def test_an_invalid_constraint_is_a_value_error(llama: LLM, field, value, message) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**{field: value}))
    with pytest.raises(ValueError, match=message):
        llama.generate("hi", params, use_tqdm=False)
    assert not llama.engine.has_unfinished_requests()


def test_nested_schema_outputs_validate(llama: LLM) -> None:
    # Room for the unbounded number a random model may write at length.
    outputs = llama.generate(PROMPTS * 25, constrained(100, max_tokens=400), use_tqdm=False)
    assert_valid(outputs)
    assert len({o.outputs[0].text for o in outputs}) > 50  # the seeds differ, not one answer


def test_greedy_outputs_validate(qwen: LLM, llama: LLM) -> None:
    # Bounded values only: greedy decoding on a random model repeats a digit forever.
    so = StructuredOutputsParams(json=SMALL_SCHEMA)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so)
    for llm in (qwen, llama):
        assert_valid(llm.generate(PROMPTS, greedy, use_tqdm=False), SMALL_SCHEMA)


def test_regex_and_choice_outputs_match(qwen: LLM) -> None:
    regex = StructuredOutputsParams(regex=REGEX)
    choice = StructuredOutputsParams(choice=CHOICES)
    params = [
        SamplingParams(temperature=1.0 if i else 0.0, seed=i, max_tokens=40, structured_outputs=c)
        for i in range(8)
        for c in (regex, choice)
    ]
    outputs = qwen.generate(PROMPTS * 4, params, use_tqdm=False)
    for output, param in zip(outputs, params, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        if param.structured_outputs is regex:
            assert re.fullmatch(REGEX, completion.text), completion.text
        else:
            assert completion.text in CHOICES
    assert len({o.outputs[0].text for o in outputs[1::2]}) > 1


def test_n_samples_each_follow_the_grammar(qwen: LLM) -> None:
    outputs = qwen.generate(PROMPTS, constrained(4, n=4), use_tqdm=False)
    assert_valid(outputs)
    texts = [c.text for c in outputs[1].outputs]
    assert len(set(texts)) == 4  # four samples, four matchers


def test_max_tokens_cuts_the_constraint_with_length(llama: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    (output,) = llama.generate(
        "hi", SamplingParams(max_tokens=6, structured_outputs=so), use_tqdm=False
    )
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 6


def test_a_terminated_grammar_stops_even_with_ignore_eos(qwen: LLM) -> None:
    so = StructuredOutputsParams(choice=["yes", "no"])
    (output,) = qwen.generate(
        "hi", SamplingParams(max_tokens=30, ignore_eos=True, structured_outputs=so), use_tqdm=False
    )
    completion = output.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.text in ("yes", "no")


def test_unconstrained_neighbours_keep_their_tokens(llama: LLM) -> None:
    free = [
        SamplingParams(temperature=0.8, seed=50 + i, max_tokens=30, ignore_eos=True)
        for i in range(4)
    ]
    alone = llama.generate(PROMPTS, free, use_tqdm=False)
    mixed = llama.generate(PROMPTS * 2, free + constrained(4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert_valid(mixed[4:])


def _swap_bytes(model_dir: str, num_blocks: int) -> int:
    config = ModelConfig.from_hf(model_dir)
    return num_blocks * PagedKVCache.bytes_per_block(
        config.num_layers, 8, config.num_kv_heads, config.head_dim, "float32"
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_samples_keep_their_grammar(qwen: LLM, qwen_dir: str, mode: str) -> None:
    params = constrained(8, n=2, schema=SMALL_SCHEMA)
    expected = qwen.generate(PROMPTS * 2, params, use_tqdm=False)
    swap = _swap_bytes(qwen_dir, 64) if mode == "swap" else 0
    tiny = make_llm(qwen_dir, 10, max_num_batched_tokens=64, preemption_mode=mode, swap_space=swap)
    got = tiny.generate(PROMPTS * 2, params, use_tqdm=False)
    stats = tiny.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out"] > 0
    assert_valid(got, SMALL_SCHEMA)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]


def test_a_compiling_grammar_does_not_hold_back_others(llama_dir: str) -> None:
    engine = LLMEngine.from_engine_args(llama_dir, device="cpu", dtype="float32", num_blocks=64)
    compiler = engine.structured_outputs.compiler
    # Both compile threads busy: the schema below compiles only after `release`.
    blocked = compiler._pool.submit(_wait_for, release := [])
    blocked2 = compiler._pool.submit(_wait_for, release)
    engine.add_request("free", "hello", SamplingParams(temperature=0, max_tokens=4))
    so = StructuredOutputsParams(json=SMALL_SCHEMA)
    for i in range(200):
        engine.add_request(f"c{i}", "hi", SamplingParams(max_tokens=40, structured_outputs=so))
    assert engine.num_waiting == 201
    finished = []
    while not finished:  # the free request runs to its end while the compile waits
        finished = [o.request_id for o in engine.step() if o.finished]
    assert finished == ["free"] and len(engine.structured_outputs.pending) == 200
    release.append(True)
    blocked.result(), blocked2.result()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(outputs) == 200 and compiler.num_grammars == 1
    assert_valid(list(outputs.values()), SMALL_SCHEMA)
    engine.close()


def _wait_for(release: list[bool]) -> None:
    import time

    while not release:
        time.sleep(0.01)


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_chat_renders_tools_through_the_template(qwen: LLM, llama: LLM, style: str) -> None:
    llm = qwen if style == "qwen" else llama
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SMALL_SCHEMA}}]
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=2)
    (with_tools,) = llm.chat(messages, params, tools=tools, use_tqdm=False)
    (without,) = llm.chat(messages, params, use_tqdm=False)
    assert '"name": "get_weather"' in with_tools.prompt and "get_weather" not in without.prompt
    assert with_tools.prompt.endswith(without.prompt.removeprefix("<|begin_of_text|>"))


def test_the_engine_ends_a_request_whose_grammar_fails_or_is_aborted(llama_dir: str) -> None:
    engine = LLMEngine.from_engine_args(llama_dir, device="cpu", dtype="float32", num_blocks=64)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    engine.add_request("bad", "hi", bad)
    engine.add_request("gone", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(
        regex="[0-9]{3}x")))  # fmt: skip
    engine.abort_request("gone")  # while compiling or once scheduled: either way it ends
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs["bad"].outputs[0].finish_reason == "abort"
    assert "gone" not in outputs or outputs["gone"].outputs[0].finish_reason == "abort"
    assert engine.stats()["num_seqs"] == 0
    engine.close()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beam_search_beams_follow_the_grammar(qwen: LLM, ignore_eos: bool) -> None:
    so = StructuredOutputsParams(json=SMALL_SCHEMA)
    params = BeamSearchParams(
        beam_width=3, max_tokens=40, ignore_eos=ignore_eos, structured_outputs=so
    )
    outputs = qwen.beam_search([{"prompt": p} for p in PROMPTS], params)
    for output in outputs:
        assert len(output.sequences) == 3
        for beam in output.sequences:
            assert beam.finish_reason == "stop", beam.text
            jsonschema.validate(json.loads(beam.text), SMALL_SCHEMA)
    free = qwen.beam_search([{"prompt": p} for p in PROMPTS], BeamSearchParams(3, 40))
    assert all(not _parses(b.text) for o in free for b in o.sequences)
    assert qwen.engine.kv_manager.num_free_blocks == qwen.engine.kv_manager.num_blocks


def test_beam_search_with_a_bad_constraint_is_a_value_error(qwen: LLM) -> None:
    bad = BeamSearchParams(2, 8, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured_outputs.regex: invalid regex"):
        qwen.beam_search(["hi"], bad)
    with pytest.raises(ValueError, match="structured_outputs: expected StructuredOutputsParams"):
        BeamSearchParams(2, 8, structured_outputs={"regex": "a"})  # type: ignore[arg-type]


def _parses(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
