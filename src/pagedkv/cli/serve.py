"""`pagedkv serve` and `pagedkv generate`: the engine from a terminal.

The engine's flags are the fields of `EngineArgs` (`--block-size` is `block_size`, ...), the
same options `LLM` takes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.runtime import kernel_cache
from pagedkv.server import exposure
from pagedkv.server.streaming import DeltaTracker
from pagedkv.server.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("pagedkv.server")


def register(subparsers: Any) -> None:
    """Add `serve` and `generate` to the `pagedkv` command."""
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics (Prometheus). Before exposing it beyond this machine, "
        "set --api-key (and TLS): see the README's server section.",
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
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, let running requests finish for this long, then abort the rest",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='the model\'s tool-call format, for tool_choice "auto" (default: hermes when '
        "the chat template spells out <tool_call>, else none)",
    )
    exposure.add_cli_args(serve)
    EngineArgs.add_cli_args(serve)
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
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(handler=run_generate)


def _engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine's options from the flags (the model path checked); on a torchrun rank > 0
    this process serves the engine's steps instead, then ends."""
    kernel_cache.announce()  # before torch loads, so the line comes at once
    from pagedkv.engine.builder import serve_rank
    from pagedkv.engine.workers import launched_rank, run_worker

    engine_args = EngineArgs.from_cli_args(args)
    path = Path(engine_args.model)
    if not ((path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())):
        raise FileNotFoundError(
            "expected a model directory with config.json or a .gguf file, "
            f"got {engine_args.model!r}"
        )
    if launched_rank() > 0:
        run_worker(engine_args, serve_rank)
    return engine_args


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    access = exposure.access_policy(args)  # bad options fail before the model loads
    limits = exposure.RequestLimits.from_cli_args(args)
    tls = exposure.tls_options(args)
    engine_args = _engine_args(args)
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.server.api import CorsOptions, create_app
    from pagedkv.server.async_engine import AsyncEngine
    from pagedkv.server.launch import serve

    name = args.served_model_name or Path(engine_args.model).resolve().name
    started = time.perf_counter()
    engine = AsyncEngine(LLMEngine.from_engine_args(engine_args), args.max_waiting_requests)
    logger.info(
        "loaded %s in %.1fs: %d KV blocks of %d tokens",
        args.model,
        time.perf_counter() - started,
        engine.engine.stats()["num_blocks"],
        args.block_size,
    )
    cors = CorsOptions(
        tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers)
    )
    app = create_app(
        engine,
        model_name=name,
        access=access,
        limits=limits,
        cors=cors,
        tool_call_parser=args.tool_call_parser,
    )
    scheme = "https" if tls.enabled else "http"
    logger.info("serving %r on %s://%s:%d/v1", name, scheme, args.host, args.port)
    serve(
        app,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        tls_kwargs=tls.uvicorn_kwargs(),
    )
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; a summary line goes to stderr."""
    engine_args = _engine_args(args)
    from pagedkv.engine.engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args)
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
                print(text, end="", flush=True)
                num_tokens += len(sample.token_ids)
                finish_reason = sample.finish_reason or finish_reason
    elapsed = time.perf_counter() - started
    engine.close()
    sys.stdout.write("\n")
    print(
        f"[{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / max(elapsed, 1e-9):.1f} tok/s), "
        f"finish_reason={finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _generate_prompt(args: argparse.Namespace, tokenizer: Any) -> str | list[int] | dict[str, Any]:
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
    return tokenizer.chat_prompt([{"role": "user", "content": args.prompt}])
