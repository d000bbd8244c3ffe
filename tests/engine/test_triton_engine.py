"""The engine end to end on the Triton backend, against a baseline backend and transformers.

Tiny random float32 models through chunked prefill, prefix caching, recompute and swap
preemption, n = 2 seeded sampling and an int8 cache: the tokens equal the baseline's (the
CPU backend; on CUDA the reference one, on the same device), and greedy ones transformers'
(up to a near-tie, see `test_engine_hf`). On CUDA the kernels run compiled; without a GPU
they run in Triton's interpreter on CPU tensors, which must be chosen before triton is first
imported, as in tests/ops/test_triton.py: set here when triton is not imported yet;
otherwise the tests that run kernels are skipped here and `test_in_fresh_process`, defined
only then, runs them in a new process."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
TRITON_PREIMPORTED = (
    not ON_GPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if not ON_GPU and not TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

from helpers import make_hf_model  # noqa: E402
from test_engine_hf import LOGPROB_TOL, NEW_TOKENS, compare_greedy, hf_greedy  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.args import ATTENTION_BACKENDS, EngineArgs  # noqa: E402
from pagedkv.ops.backend import get_backend  # noqa: E402

interpreted = pytest.mark.skipif(
    TRITON_PREIMPORTED,
    reason="triton was imported without TRITON_INTERPRET: see test_in_fresh_process",
)
DEVICE = "cuda" if ON_GPU else "cpu"
# What the Triton runs are compared with, on their device: a seeded sample draws from its
# device's generator, and CUDA's stream differs from the CPU's.
BASELINE = "reference" if ON_GPU else "cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)

# (arch, block_size, num_blocks, preemption mode): pools fewer than the batch needs, so it
# preempts; block sizes off powers of two. Gemma 3's sliding layers keep a KV cache group of
# their own: a second block table per step, planned for its window.
CASES = [("llama", 4, 25, "recompute"), ("qwen2", 5, 20, "swap"), ("gemma3", 3, 60, "recompute")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (model dir, prompts sharing a 21-token prefix), each built on first use."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(arch: str) -> tuple[Path, list[list[int]]]:
        if arch not in made:
            model_dir = make_hf_model(tmp_path_factory.mktemp(arch), arch, seed=7)
            rng = random.Random(arch)
            shared = [rng.randrange(3, 512) for _ in range(21)]
            tails = (3, 26, 11, 40, 1)
            made[arch] = (
                model_dir,
                [shared + [rng.randrange(3, 512) for _ in range(k)] for k in tails],
            )
        return made[arch]

    return get


@pytest.fixture
def launches(monkeypatch) -> Counter:
    """Calls of the Triton backend's kernel launchers, counted as they pass through to them:
    the proof that an engine ran on the backend (the CPU one gives the same tokens)."""
    import pagedkv.ops.triton as backend

    counts: Counter = Counter()
    for name in ("write_kv", "prefill_attention", "decode_attention"):
        monkeypatch.setattr(backend, name, counting(counts, name, getattr(backend, name)))
    return counts


def counting(counts: Counter, name: str, launch: Callable) -> Callable:
    """`launch`, adding 1 to ``counts[name]`` per call."""

    def counted(*args, **kwargs):
        counts[name] += 1
        return launch(*args, **kwargs)

    return counted


def generate(model_dir: Path, prompts: list[list[int]], params: SamplingParams, backend: str,
             launches: Counter, **options) -> tuple[list, dict]:  # fmt: skip
    """The first prompt alone (so the others find the shared prefix cached), then the
    rest in one batch; returns the outputs and the engine's stats. Checks that every
    Triton launcher ran for backend "triton", and none for another."""
    before = dict(launches)
    device = "cpu" if backend == "cpu" else DEVICE
    llm = LLM(model_dir, dtype="float32", device=device, attention_backend=backend,
              max_num_batched_tokens=16, enable_prefix_caching=True, **options)  # fmt: skip
    outputs = llm.generate(prompts[:1], params, use_tqdm=False)
    outputs += llm.generate(prompts[1:], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
    if backend == "triton":
        assert all(launches[name] > before.get(name, 0) for name in launches), launches
        assert len(launches) == 3, launches
    else:
        assert dict(launches) == before, launches
    return outputs, stats


def assert_same_samples(outputs, expected) -> None:
    """Every sample's tokens equal, and logprobs close where they were asked for."""
    for got, want in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        for sample, reference in zip(got.outputs, want.outputs, strict=True):
            for step, token in enumerate(sample.token_ids if sample.logprobs else ()):
                delta = sample.logprobs[step][token] - reference.logprobs[step][token]
                assert abs(delta) < LOGPROB_TOL, f"step {step}"


@interpreted
@pytest.mark.parametrize(("arch", "block_size", "num_blocks", "mode"), CASES)
def test_greedy_matches_baseline_and_transformers(
    models, launches, arch: str, block_size: int, num_blocks: int, mode: str
) -> None:
    model_dir, prompts = models(arch)
    options = dict(block_size=block_size, num_blocks=num_blocks, preemption_mode=mode,
                   swap_space="1MiB" if mode == "swap" else 0)  # fmt: skip
    outputs, stats = generate(model_dir, prompts, GREEDY, "triton", launches, **options)
    expected, _ = generate(model_dir, prompts, GREEDY, BASELINE, launches, **options)
    assert_same_samples(outputs, expected)
    compared = compare_greedy(hf_greedy(model_dir, prompts), outputs)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few tokens compared"
    assert stats["prefix_cache_hits"] >= 16 and stats["num_preemptions"] > 0, stats
    if mode == "swap":
        assert stats["num_swapped_out"] > 0, stats


@interpreted
def test_seeded_samples_match_baseline(models, launches) -> None:
    model_dir, prompts = models("llama")
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=11, max_tokens=6,
                            ignore_eos=True, logprobs=1)  # fmt: skip
    outputs, _ = generate(
        model_dir, prompts[:2], params, "triton", launches, block_size=8, num_blocks=32
    )
    expected, _ = generate(
        model_dir, prompts[:2], params, BASELINE, launches, block_size=8, num_blocks=32
    )
    assert_same_samples(outputs, expected)
    assert all(o.outputs[0].token_ids != o.outputs[1].token_ids for o in outputs)


@interpreted
def test_int8_cache_matches_baseline(models, launches) -> None:
    """qwen3: head_dim 32 and q/k norms, keys and values quantized as they are written."""
    model_dir, prompts = models("qwen3")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    options = dict(block_size=5, num_blocks=40, kv_cache_dtype="int8")
    outputs, stats = generate(model_dir, prompts[:3], params, "triton", launches, **options)
    expected, _ = generate(model_dir, prompts[:3], params, BASELINE, launches, **options)
    assert_same_samples(outputs, expected)
    assert stats["prefix_cache_hits"] >= 16, stats


@interpreted
def test_backend_names_are_checked() -> None:
    for name in ATTENTION_BACKENDS:
        get_backend(name, torch.device("cpu"))  # every choice of the option is registered
    with pytest.raises(ValueError, match="attention_backend: expected one of .*'tritn'"):
        EngineArgs(model="unused", attention_backend="tritn")


def test_triton_refused_on_cpu_without_interpreter() -> None:
    """What an engine's start-up (`warmup`) and every kernel call say on a CPU without
    ``TRITON_INTERPRET=1``."""
    code = (
        "import torch\n"
        "from pagedkv.ops import warmup\n"
        "cache = torch.zeros(4, 2, 2, 16)\n"
        "warmup(cache, cache.clone(), 4, backend='triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert "ValueError: backend: expected CUDA tensors for backend 'triton'" in result.stderr


if TRITON_PREIMPORTED:

    def test_in_fresh_process() -> None:
        """This file in a new interpreter-mode process, as this one cannot interpret."""
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        root = Path(__file__).resolve().parents[2]
        cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x", "-p",
               "no:cacheprovider"]  # fmt: skip
        result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                timeout=900)  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
