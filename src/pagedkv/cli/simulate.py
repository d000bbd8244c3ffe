"""`pagedkv plan` and `pagedkv simulate`: the planner and simulator on the command line.

Only the standard library at import time; matplotlib is imported by `--plot` alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagedkv.config import SchedulerConfig, parse_count, parse_size
from pagedkv.memory.groups import group_layers
from pagedkv.sim.planner import (
    ACTIVATION_MARGIN,
    builtin_models,
    dtype_bytes,
    format_plan,
    kv_bytes_per_block,
    kv_bytes_per_token,
    load_model,
    plan_memory,
)
from pagedkv.sim.policies import POLICIES, StepCost, create_policy
from pagedkv.sim.simulator import PolicyResult, simulate
from pagedkv.sim.weight_formats import QUANTIZATIONS
from pagedkv.sim.workload import (
    DEPRECATED_WORKLOADS,
    WORKLOAD_MIXES,
    WORKLOADS,
    Request,
    load_trace,
    make_workload,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` and `simulate` subcommands."""
    models = ", ".join(builtin_models())
    plan = subparsers.add_parser(
        "plan",
        help="how much KV cache a model leaves on a GPU",
        description="Weights, KV bytes per token and block, and whether the weights and a "
        f"full-context sequence fit. Built-in models: {models}.",
    )
    plan.add_argument("--model", required=True, help="built-in name, model dir or config.json")
    plan.add_argument("--memory", required=True, help="memory per GPU, e.g. 80GiB")
    plan.add_argument(
        "--context", help="tokens per sequence, e.g. 128k (default: the model's maximum)"
    )
    plan.add_argument("--dtype", default="bf16", help="weight dtype (default bf16)")
    plan.add_argument(
        "--kv-cache-dtype", "--kv-dtype", dest="kv_dtype",
        help="KV cache dtype (default: --dtype); int8 counts its scale per token and KV head",
    )  # fmt: skip
    plan.add_argument(
        "--quantization",
        default="none",
        help=f"weights' storage: {', '.join(QUANTIZATIONS)} (GGUF block formats, mixed as "
        "llama-quantize mixes them; default none: every weight in --dtype)",
    )
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    plan.add_argument(
        "--activation-margin",
        type=float,
        default=ACTIVATION_MARGIN,
        metavar="SHARE",
        help="share of memory kept from the KV cache for activations, the CUDA context and "
        f"allocator slack (default {ACTIVATION_MARGIN})",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(handler=run_plan)

    sim = subparsers.add_parser(
        "simulate",
        help="replay a workload against contiguous and paged KV allocation",
        description=textwrap.fill(
            "Replay a workload on a simulated clock (one token per running request per step) "
            f"against the policies {', '.join(POLICIES)}. The paged policies run the engine's "
            "own scheduler and KV cache manager, with a cost model in place of the model."
        ),
        epilog=_workloads_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument("--model", required=True, help="built-in name, model dir or config.json")
    sim.add_argument("--kv-memory", required=True, help="KV cache memory, e.g. 40GiB")
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--workload",
        choices=(*WORKLOADS, *DEPRECATED_WORKLOADS),
        metavar="{" + ",".join(WORKLOADS) + "}",
        help="a built-in synthetic workload (listed below)",
    )
    source.add_argument(
        "--trace",
        help="JSONL: arrival, prompt_len, output_len [, prefix_group, prefix_len] per line",
    )
    sim.add_argument("--num-requests", type=int, default=1000)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--rate",
        type=float,
        help="Poisson arrivals per step (default: all at step 0; long-context: 0.01)",
    )
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument(
        "--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="bf16",
        help="KV cache dtype (default bf16); int8 counts its scale per token and KV head",
    )  # fmt: skip
    sim.add_argument("--tp", type=int, default=1, help="KV heads split over this many GPUs")
    sim.add_argument(
        "--max-model-len",
        help="tokens contiguous-max reserves per request (default: the longest request that fits)",
    )
    sim.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset of the policies"
    )
    engine = SchedulerConfig()
    sim.add_argument(
        "--max-num-seqs",
        type=int,
        default=engine.max_num_seqs,
        help=f"paged policies: sequences in one step at most (default {engine.max_num_seqs})",
    )
    sim.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=engine.max_num_batched_tokens,
        help="paged policies: tokens in one step at most "
        f"(default {engine.max_num_batched_tokens})",
    )
    sim.add_argument(
        "--token-cost",
        type=float,
        default=0.0,
        help="paged policies: a step takes 1 + this x its batched tokens clock steps (default 0)",
    )
    sim.add_argument("--plot", metavar="DIR", help="write PNG figures to DIR")
    sim.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sim.set_defaults(handler=run_simulate)


def _workloads_help() -> str:
    """The built-in workloads and their mixes, one wrapped paragraph each."""
    mixes = [
        textwrap.fill(
            f"{name}: {WORKLOAD_MIXES[name]}", initial_indent="  ", subsequent_indent="    "
        )
        for name in WORKLOADS
    ]
    return "\n".join(["built-in workloads (--workload):", *mixes])


def run_plan(args: argparse.Namespace) -> int:
    """Handler of `pagedkv plan`. Raises ValueError for bad input (one-line message)."""
    model = load_model(args.model)
    context = None if args.context is None else parse_count(args.context)
    plan = plan_memory(
        model,
        parse_size(args.memory),
        name=str(args.model),
        context=context,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        tp=args.tp,
        block_size=args.block_size,
        activation_margin=args.activation_margin,
        quantization=args.quantization,
    )
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0


def _requests(args: argparse.Namespace) -> tuple[str, list[Request]]:
    if args.trace:
        return str(args.trace), load_trace(args.trace)
    if args.workload in DEPRECATED_WORKLOADS:
        new_name = DEPRECATED_WORKLOADS[args.workload]
        print(f"pagedkv simulate: --workload {args.workload} is now {new_name}", file=sys.stderr)
        args.workload = new_name
    return args.workload, make_workload(args.workload, args.num_requests, args.seed, args.rate)


def _policy_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in POLICIES for n in names):
        raise ValueError(f"policies: expected names from {', '.join(POLICIES)}, got {text!r}")
    return names


def _setup(args: argparse.Namespace) -> tuple[dict[str, Any], list[Request]]:
    """The run's header (model, memory, sizes) and its requests, from validated arguments."""
    model = load_model(args.model)
    if args.block_size <= 0:
        raise ValueError(f"block_size: expected > 0, got {args.block_size}")
    if not (math.isfinite(args.token_cost) and args.token_cost >= 0):
        raise ValueError(f"token-cost: expected a finite number >= 0, got {args.token_cost!r}")
    per_token = kv_bytes_per_token(model, args.kv_dtype, args.tp)
    kv_memory = parse_size(args.kv_memory)
    capacity = kv_memory // per_token
    if capacity <= 0:
        raise ValueError(
            f"kv-memory: expected room for at least one token ({per_token:,} B), "
            f"got {kv_memory:,} B"
        )
    workload, requests = _requests(args)
    # By default contiguous-max reserves the longest request the memory can hold at all:
    # a server sized for its workload, the most favourable choice for that policy.
    longest = max((r.total_len for r in requests if r.total_len <= capacity), default=capacity)
    header = {
        "model": str(args.model),
        "workload": workload,
        "requests": len(requests),
        "kv_memory_bytes": kv_memory,
        "kv_dtype": args.kv_dtype,
        "dtype_bytes": dtype_bytes(args.kv_dtype),
        "kv_bytes_per_token": per_token,
        "block_size": args.block_size,
        "tp": args.tp,
        "capacity_tokens": capacity,
        "num_blocks": kv_memory
        // kv_bytes_per_block(model, args.kv_dtype, args.tp, args.block_size),
        "kv_group_windows": group_layers(model.sliding_windows, model.num_layers).windows,
        "max_model_len": longest if args.max_model_len is None else parse_count(args.max_model_len),
    }
    return header, requests


def run_simulate(args: argparse.Namespace) -> int:
    """Handler of `pagedkv simulate`. Raises ValueError for bad input (one-line message)."""
    names = _policy_names(args.policies)
    header, requests = _setup(args)
    sizes = {
        "capacity_tokens": header["capacity_tokens"],
        "num_blocks": header["num_blocks"],
        "block_size": header["block_size"],
        "max_len": header["max_model_len"],
        "scheduler": SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        "step_cost": StepCost(1.0, args.token_cost),
        "windows": header["kv_group_windows"],
    }
    results = []
    for name in names:
        began = time.perf_counter()
        with _progress_bar(name, len(requests)) as progress:
            result = simulate(requests, create_policy(name, **sizes), progress=progress)
        seconds = time.perf_counter() - began
        if args.plot:
            # Replay once more recording ~300 map snapshots: the run is deterministic.
            result = simulate(
                requests,
                create_policy(name, **sizes),
                record=True,
                snapshot_every=(result.engine_steps or result.steps) // 300,
            )
        results.append((result, seconds))
    if args.plot:
        from pagedkv.sim import plots

        title = (
            f"{args.model}, {header['workload']} ({len(requests):,} requests), "
            f"{header['kv_memory_bytes'] / 2**30:g} GiB KV"
        )
        plots.write_plots(
            [r for r, _ in results], Path(args.plot), title, header["kv_bytes_per_token"]
        )
    if args.json:
        policies = [{**r.to_dict(), "wall_seconds": round(s, 3)} for r, s in results]
        print(json.dumps({**header, "policies": policies}, indent=2))
    else:
        print(format_results(header, results))
    return 0


@contextlib.contextmanager
def _progress_bar(policy: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar of requests done on stderr while a policy replays, when stderr is a
    terminal (else None: no output)."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=policy, unit="req", leave=True, mininterval=0.5) as bar:

        def update(done: int) -> None:
            if done != bar.n:
                bar.update(done - bar.n)

        yield update


# The table's columns between the policy name and the wall time: (heading, field, format).
_COLUMNS = (
    ("admit", "admitted", ","),
    ("queued", "queued", ","),
    ("reject", "rejected", ","),
    ("preempt", "preemptions", ","),
    ("steps", "steps", ","),
    ("peak", "peak_concurrency", ","),
    ("mean", "mean_concurrency", ",.1f"),
    ("util", "mean_kv_utilization", ".1%"),
    ("int.frag", "internal_fragmentation", ".1%"),
    ("ext.frag", "external_fragmentation", ".1%"),
    ("stalls", "fragmentation_stalls", ","),
)


def format_results(header: dict[str, Any], results: list[tuple[PolicyResult, float]]) -> str:
    """One row per policy, then the first fragmentation stalls of each policy."""
    lines = [
        f"{header['model']}: {header['kv_bytes_per_token']:,} B/token ({header['kv_dtype']}), "
        f"{header['kv_memory_bytes'] / 2**30:g} GiB KV, block {header['block_size']}, "
        f"workload {header['workload']} ({header['requests']:,} requests)"
    ]
    rows = [("policy", *(heading for heading, _, _ in _COLUMNS), "secs")]
    rows += [
        (r.policy, *(format(getattr(r, name), spec) for _, name, spec in _COLUMNS), f"{secs:.2f}")
        for r, secs in results
    ]
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    for name, *cells in rows:
        right = (c.rjust(w) for c, w in zip(cells, widths[1:], strict=True))
        lines.append("  ".join([name.ljust(widths[0]), *right]))
    for r, _ in results:
        for ex in r.stall_examples:
            lines.append(
                f"stall ({r.policy}): step {ex['step']:,}, request {ex['request']} "
                f"needs {ex['need_tokens']:,} tokens; free {ex['free_tokens']:,} in "
                f"total, largest free region {ex['largest_free_tokens']:,}"
            )
    lines.append(
        "util = tokens held / tokens reserved; frag = share of KV memory; stalls = "
        "steps the queue head waited with enough free memory in total"
    )
    return "\n".join(lines)
