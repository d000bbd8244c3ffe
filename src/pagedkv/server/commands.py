"""`pagedkv serve` and `pagedkv generate`: the engine from a terminal.

Flags are named after `LLM`'s arguments (`--block-size` is `block_size`, ...). Torch and the
engine are imported inside the handlers, so `pagedkv --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.config import parse_size

logger = logging.getLogger("pagedkv.server")


def add_engine_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    """Add the `LLM(...)` keyword arguments as flags (see `engine_kwargs`)."""
    group = parser.add_argument_group("engine (the arguments of LLM)")
    group.add_argument(
        "--model",
        required=model_required,
        metavar="DIR",
        help="Hugging Face-format model directory (config.json, *.safetensors)",
    )
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--num-blocks", type=int, default=None, help="fix the KV pool size")
    group.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="BYTES",
        help="size the KV pool by memory, e.g. 4GiB (when --num-blocks is unset)",
    )
    group.add_argument(
        "--swap-space",
        default="0",
        metavar="BYTES",
        help="host memory for swapped-out blocks, e.g. 1GiB",
    )
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    group.add_argument("--seed", type=int, default=0, help="engine seed")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM`/`LLMEngine.from_engine_args` keyword arguments from parsed flags."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        swap_space=parse_size(args.swap_space),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        seed=args.seed,
    )


def prefer_passive_omp() -> None:
    """Make idle OpenMP threads sleep instead of spin, unless the user chose otherwise.

    On a shared CPU, spinning torch threads fight other processes for cores: measured here
    with the machine otherwise busy, a demo step took 4x longer with the default policy.
    Takes effect only before torch is first imported (the handlers import it lazily).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _check_model_dir(model: str) -> None:
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"expected a model directory with config.json, got {model!r}")


def register(subparsers: Any) -> None:
    """Add `serve` and `generate` to the `pagedkv` command."""
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics (Prometheus).",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model directory's name)",
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 503 when this many requests already wait",
    )
    add_engine_args(serve)
    serve.set_defaults(handler=run_serve)

    gen = subparsers.add_parser(
        "generate",
        help="generate from one prompt, streaming to the terminal",
        description="Load a model and stream one completion of --prompt to stdout.",
    )
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument(
        "--prompt-token-ids",
        metavar="IDS",
        help="comma-separated token ids (for a model without a tokenizer)",
    )
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(handler=run_generate)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    prefer_passive_omp()
    import uvicorn

    from pagedkv.server.api import create_app
    from pagedkv.server.async_engine import AsyncEngine

    _check_model_dir(args.model)
    name = args.served_model_name or Path(args.model).resolve().name
    started = time.perf_counter()
    engine = AsyncEngine.from_engine_args(
        args.model, max_waiting_requests=args.max_waiting_requests, **engine_kwargs(args)
    )
    stats = engine.engine.stats()
    logger.info(
        "loaded %s in %.1fs: %d KV blocks of %d tokens",
        args.model,
        time.perf_counter() - started,
        stats.get("num_blocks", 0),
        args.block_size,
    )
    app = create_app(engine, model_name=name)
    logger.info("serving %r on http://%s:%d/v1", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; a summary line goes to stderr."""
    prefer_passive_omp()
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams
    from pagedkv.server.streaming import DeltaTracker

    _check_model_dir(args.model)
    engine = LLMEngine.from_engine_args(args.model, **engine_kwargs(args))
    prompt = _generate_prompt(args, engine.tokenizer)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    engine.add_request("generate-0", prompt, params)
    tracker = DeltaTracker(stop=args.stop)
    started = time.perf_counter()
    num_tokens, finish_reason = 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            for sample in tracker.update(output).samples:
                text = (
                    sample.text
                    if engine.tokenizer is not None
                    else "".join(f" {t}" for t in sample.token_ids)
                )
                sys.stdout.write(text)
                sys.stdout.flush()
                num_tokens = sample.num_tokens
                finish_reason = sample.finish_reason or finish_reason
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    print(
        f"[{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / max(elapsed, 1e-9):.1f} tok/s), "
        f"finish_reason={finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _generate_prompt(args: argparse.Namespace, tokenizer: Any) -> str | list[int]:
    if args.prompt_token_ids is not None:
        try:
            return [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(
                "--prompt-token-ids: expected comma-separated integers, "
                f"got {args.prompt_token_ids!r}"
            ) from None
    if tokenizer is None:
        raise ValueError("the model directory has no tokenizer: pass --prompt-token-ids")
    if not args.chat:
        return args.prompt
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)
