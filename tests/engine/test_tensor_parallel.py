"""Tensor parallelism over 2 CPU processes (gloo) against the same engine in one process.

Each rank holds half of the heads, the MLP and the vocabulary, and only the summation
order of the all-reduces differs from one process: greedy tokens must be equal (up to a
near-tie in the one-process logprobs) and logprobs within 2e-3, with preemption, prefix
caching hits and seeded sampling included.
"""

from __future__ import annotations

import gc
import os
import random
import socket
import subprocess
import sys
import time

import pytest
from helpers import make_hf_model

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine.builder import allocation_figures
from pagedkv.errors import WorkerFailed
from pagedkv.sim.planner import kv_bytes_per_token, kv_heads_per_gpu

MARGIN = 1e-4
LOGPROB_TOL = 2e-3
NEW_TOKENS = 10

# (arch, config overrides): Qwen2 brings QKV bias, a tied LM head and a vocabulary that 2
# does not divide (the last rank's rows are padding); one KV head is replicated on both.
CASES = [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 1}),
    ("qwen2", {"vocab_size": 509}),
    ("qwen3", {}),
    # Gemma 3's scaled embeddings, sandwich norms and logit cap; Phi-4's fused checkpoint
    # tensors and partial rotary.
    ("gemma3", {}),
    ("phi4", {}),
]


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _run(model_dir, prompts, params, **kwargs):
    with LLM(model_dir, dtype="float32", **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.stats()


def _compare(expected, got) -> int:
    """Tokens equal up to each output's first near-tie; logprobs within tolerance."""
    compared = 0
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        for step, token in enumerate(a.token_ids):
            top = sorted(a.logprobs[step].values(), reverse=True)
            if len(top) > 1 and top[0] - top[1] < MARGIN:
                break
            assert b.token_ids[step] == token, f"step {step}"
            diff = abs(b.logprobs[step][token] - a.logprobs[step][token])
            assert diff < LOGPROB_TOL, f"step {step}: logprob differs by {diff}"
            compared += 1
    return compared


@pytest.mark.parametrize(("arch", "overrides"), CASES, ids=lambda c: str(c))
def test_greedy_matches_one_process(tmp_path, arch, overrides):
    model_dir = make_hf_model(tmp_path, arch, **overrides)
    vocab = overrides.get("vocab_size", 512)
    prompts = _prompts(vocab, [1, 7, 16, 45, 130])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)
    expected, _ = _run(model_dir, prompts, params, block_size=8)
    got, _ = _run(model_dir, prompts, params, block_size=8, tensor_parallel_size=2)
    assert _compare(expected, got) >= len(prompts) * NEW_TOKENS // 2


def test_preemption_prefix_hits_and_sampling_match(tmp_path):
    """A pool too small for the batch (recompute preemptions), prompts sharing a prefix
    (cache hits), and seeded sampling: the same outputs with 2 ranks as with 1."""
    model_dir = make_hf_model(tmp_path, "llama")
    rng = random.Random(1)
    prefix = [rng.randrange(3, 512) for _ in range(32)]
    prompts = [prefix + p for p in _prompts(512, [5, 9, 13, 17, 21, 25], seed=2)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    options = {"block_size": 4, "num_blocks": 40, "max_num_seqs": 6}
    expected, stats_1 = _run(model_dir, prompts, greedy, **options)
    got, stats_2 = _run(model_dir, prompts, greedy, tensor_parallel_size=2, **options)
    assert stats_1["num_preemptions"] > 0 and stats_2["num_preemptions"] > 0
    assert stats_2["prefix_cache_hits"] > 0
    assert _compare(expected, got) > 0
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    one, _ = _run(model_dir, prompts[:3], sampled, block_size=4)
    two, _ = _run(model_dir, prompts[:3], sampled, block_size=4, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]


def test_allocation_agrees_with_the_planner(tmp_path):
    model_dir = make_hf_model(tmp_path, "qwen3")
    with LLM(model_dir, dtype="float32", num_blocks=64, tensor_parallel_size=2) as llm:
        runner = llm.engine.runner
        figures = allocation_figures(runner.model, runner.kv_cache)
        config = llm.engine.model_config
    assert figures["num_blocks"] == 64
    assert figures["kv_heads_per_gpu"] == kv_heads_per_gpu(config, 2) == 1
    assert figures["kv_bytes_per_token"] == kv_bytes_per_token(config, "float32", 2)
    planned_weights = config.num_parameters() * 4 / 2
    assert abs(figures["weight_bytes"] - planned_weights) / planned_weights < 0.1


def test_size_that_does_not_divide_the_heads_is_refused(tmp_path):
    model_dir = make_hf_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a divisor of the 4"):
        LLM(model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected an int >= 1"):
        LLM(model_dir, tensor_parallel_size=0)


def test_dead_worker_fails_loudly_with_its_rank(tmp_path):
    model_dir = make_hf_model(tmp_path, "llama")
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        llm.engine.runner.workers[0].process.kill()
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match="tensor-parallel rank 1 failed") as failure:
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert failure.value.rank == 1
        assert time.monotonic() - started < 10
        with pytest.raises(WorkerFailed, match="rank 1"):
            llm.engine.check_health()
    finally:
        llm.close()


def test_torchrun_launch_matches_one_process(tmp_path):
    """Ranks started by a launcher (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as torchrun sets
    them): rank 1 serves steps, rank 0 prints the same tokens as one process does."""
    model_dir = make_hf_model(tmp_path, "llama")
    command = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(model_dir),
               "--prompt-token-ids", "5,6,7,8", "--max-tokens", "8",
               "--dtype", "float32"]  # fmt: skip
    alone = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = []
    for rank in (1, 0):
        env = os.environ | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "PYTHONFAULTHANDLER": "1"}  # fmt: skip  # a crash shows its stack
        ranks.append(subprocess.Popen(
            [*command, "--tensor-parallel-size", "2"], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        ))  # fmt: skip
    outputs = [process.communicate(timeout=120) for process in ranks]
    codes = [process.returncode for process in ranks]
    assert codes == [0, 0], "\n".join(
        f"rank {rank} exited {code}; stderr ends:\n{err[-2000:]}"
        for rank, code, (_, err) in zip((1, 0), codes, outputs, strict=True)
    )
    assert outputs[1][0] == alone.stdout and alone.stdout.split()
    assert outputs[0][0] == ""  # rank 1 printed nothing: it only ran steps


def test_swap_beams_and_forks_match(tmp_path):
    """Swapped-out blocks (each rank swaps its own heads), beam search (forks that share
    blocks, copy-on-write of a shared last block) and n = 2 samples: the same with 2 ranks."""
    model_dir = make_hf_model(tmp_path, "qwen2")
    prompts = _prompts(512, [9, 14, 19, 23, 27, 31], seed=3)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)
    options = {"block_size": 4, "num_blocks": 36, "preemption_mode": "swap", "swap_space": 2**20}
    expected, stats_1 = _run(model_dir, prompts, greedy, **options)
    got, stats_2 = _run(model_dir, prompts, greedy, tensor_parallel_size=2, **options)
    assert stats_1["num_swapped_out"] > 0 and stats_2["num_swapped_out"] > 0
    assert _compare(expected, got) > 0
    forks = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5)
    one, _ = _run(model_dir, prompts[:2], forks, block_size=4)
    two, _ = _run(model_dir, prompts[:2], forks, block_size=4, tensor_parallel_size=2)
    assert [[s.token_ids for s in o.outputs] for o in one] == [
        [s.token_ids for s in o.outputs] for o in two
    ]
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    results = []
    for size in (1, 2):
        with LLM(model_dir, dtype="float32", block_size=4, tensor_parallel_size=size) as llm:
            results.append(llm.beam_search(prompts[:2], beams))
    for a, b in zip(*results, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


def test_an_engine_dropped_without_close_releases_its_workers(tmp_path):
    model_dir = make_hf_model(tmp_path, "llama")
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2)
    process = llm.engine.runner.workers[0].process
    del llm
    gc.collect()
    assert not process.is_alive()
    with LLM(model_dir, dtype="float32", tensor_parallel_size=2) as again:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        assert again.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
