"""The `LLM` / `LLMEngine` surface: prompt forms, text, stop conditions, stats."""

from __future__ import annotations

import pytest
from helpers import make_hf_model, make_tokenizer

from pagedkv import LLM, SamplingParams
from pagedkv.engine.engine import LLMEngine

STATS_KEYS = {
    "num_blocks",
    "num_free_blocks",
    "num_used_blocks",
    "num_cached_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_cow_copies",
    "num_swapped_out",
    "num_requests_running",
    "num_requests_waiting",
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = make_hf_model(tmp_path_factory.mktemp("api"), "qwen2", seed=2)
    make_tokenizer(model_dir, vocab_size=400)
    return LLM(model_dir, device="cpu", num_blocks=128, block_size=8, max_num_batched_tokens=64)


def test_prompt_forms_and_input_order(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate([text, ids, {"prompt_token_ids": ids}, [5, 6]], params, use_tqdm=False)
    assert outputs[0].prompt == text and outputs[0].prompt_token_ids == ids
    assert [o.prompt_token_ids for o in outputs[1:]] == [ids, ids, [5, 6]]
    first = outputs[0].outputs[0]
    assert outputs[1].outputs[0].token_ids == first.token_ids == outputs[2].outputs[0].token_ids
    assert first.text == tokenizer.decode(first.token_ids)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    # A single flat token list is one prompt; per-prompt params are honoured.
    single = llm.generate(ids, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == first.token_ids
    lengths = [
        len(o.outputs[0].token_ids)
        for o in llm.generate(
            [ids, ids], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=4)], use_tqdm=False
        )
    ]
    assert lengths == [2, 4]


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("A paged KV cache")
    free = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(free.text) >= 4, "need some text to cut"
    stop = free.text[2:4]
    cut = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids
    token = free.token_ids[3]
    by_id = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[token]),
        use_tqdm=False,
    )[0].outputs[0]
    index = free.token_ids.index(token)
    assert by_id.token_ids == free.token_ids[: index + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token


def test_eos_ends_a_completion(llm: LLM) -> None:
    engine = llm.engine
    engine.scheduler.eos_token_ids = frozenset(range(400))  # every token is an end
    try:
        output = llm.generate([5, 6, 7], SamplingParams(max_tokens=8), use_tqdm=False)[0]
        ignored = llm.generate(
            [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
        )[0]
    finally:
        engine.scheduler.eos_token_ids = frozenset(engine.model_config.eos_token_ids)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 1
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert len(ignored.outputs[0].token_ids) == 3


def test_engine_api_and_stats(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    assert engine.model_config.architecture == "Qwen2ForCausalLM"
    engine.add_request("x", "héllo wörld", SamplingParams(max_tokens=3, seed=0), arrival_time=1.0)
    assert engine.num_waiting == 1 and engine.num_running == 0
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
        assert engine.num_running + engine.num_waiting <= 1
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3]
    assert seen[-1].finished and not seen[0].finished
    metrics = seen[-1].metrics
    assert metrics.arrival_time == 1.0 and metrics.finished_time >= metrics.first_token_time
    stats = llm.stats()
    assert STATS_KEYS <= set(stats)
    assert stats["num_used_blocks"] == 0 and stats["num_requests_running"] == 0


def test_bad_requests_raise_value_error(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("a", [1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("a", {"text": "x"}, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [5] * 1024, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_sizing_arguments(tmp_path) -> None:
    model_dir = make_hf_model(tmp_path, "llama", seed=1)
    # llama test model: 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 (K, V) x 16 = 8 KiB.
    llm = LLM(model_dir, device="cpu", kv_cache_memory="80KiB", swap_space="32KiB")
    assert llm.stats()["num_blocks"] == 10 and llm.stats()["num_host_blocks"] == 4
    auto = LLM(model_dir, device="cpu", max_num_seqs=2)
    assert auto.stats()["num_blocks"] == 2 * 1024 // 16  # capped by 2 full-length sequences
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model_dir, device="cpu", num_blocks=8, preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(model_dir, device="cpu", kv_cache_memory="1KiB")


def test_a_failed_step_aborts_its_requests_and_the_engine_recovers(llm: LLM, monkeypatch) -> None:
    prompt = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    other = list(range(100, 150))

    def broken(step):
        raise RuntimeError("device lost")

    engine.add_request("doomed", other, params)
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.stats()["num_cached_blocks"] == 0  # nothing unwritten stays indexed
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
