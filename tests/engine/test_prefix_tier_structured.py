"""A request under structured outputs reads its prefix from the disk tier too: it waits for
its grammar (made to end late here, as a new schema's does), then for its blocks, and gives
the tokens of a cold cache."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

from helpers import make_chat_tokenizer, make_hf_model

from pagedkv import LLM, SamplingParams, StructuredOutputsParams

BLOCK_SIZE = 4


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", dtype="float32", num_blocks=64, block_size=BLOCK_SIZE,
               max_num_batched_tokens=64, **kwargs)  # fmt: skip


def compile_later(llm: LLM) -> None:
    """Each compile ends a moment after it is asked for, so the request waits for it."""
    compiler = llm.engine.structured_outputs.compiler
    submit = compiler.submit

    def later(params: StructuredOutputsParams) -> Future:
        done: Future = Future()
        compiled = submit(params)
        threading.Timer(0.2, lambda: done.set_result(compiled.result())).start()
        return done

    compiler.submit = later


def test_a_constrained_request_hits_the_disk_tier_after_a_restart(tmp_path) -> None:
    model = str(make_chat_tokenizer(make_hf_model(tmp_path / "m", "llama", seed=3), "llama3"))
    rng = random.Random(4)
    prompt = [rng.randrange(3, 400) for _ in range(37)]
    regex = StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}")  # new to this process
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=regex)
    directory = str(tmp_path / "tier")
    with make_llm(model, prefix_cache_dir=directory) as first:  # saves the prompt's blocks
        first.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    with make_llm(model, prefix_cache_dir=directory) as restarted:
        compile_later(restarted)
        served = restarted.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        stats = restarted.stats()
    with make_llm(model, enable_prefix_caching=False) as llm:
        cold = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert stats["prefix_cache_disk_hits"] == (len(prompt) - 1) // BLOCK_SIZE
    assert served.token_ids == cold.token_ids and served.text == cold.text
