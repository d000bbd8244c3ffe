"""Serving latency under load: N concurrent streaming clients against `pagedkv serve`.

Starts `pagedkv serve` in its own process on a random-weight Llama-style model (the demo's
5M-parameter shape unless `--model DIR`) and a free port, then runs N clients for a bounded
time: each sends streaming `/v1/completions` requests back to back (token-id prompts of
random length, random `max_tokens`, EOS ignored) and records time to first token (TTFT),
the gaps between token chunks (inter-token latency, ITL), output tokens (`usage`) and
errors, after two warm-up requests. Clients stop starting requests at the deadline and
finish the ones in flight. Afterwards `/metrics` must show every KV block back in the pool.

    python benchmarks/bench_server.py --quick            # 1 then 4 clients, 8 s each
    python benchmarks/bench_server.py --num-clients 1 16 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import launch_server, print_table, write_results

MODEL_NAME = "bench"


@dataclass
class ClientStats:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: Path, port: int, args: argparse.Namespace) -> subprocess.Popen:
    """`pagedkv serve` in a child process; returns once /health answers."""
    serve_args = [
        "--model", str(model_dir), "--served-model-name", MODEL_NAME, "--device", "cpu",
        "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    return launch_server(serve_args, port, timeout=300)


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], stats: ClientStats
) -> None:
    sent = time.perf_counter()
    last = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            stats.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                stats.errors.append(chunk["error"]["message"])
                return
            if chunk.get("usage"):
                stats.output_tokens += chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if last is None:
                stats.ttft.append(now - sent)
            else:
                stats.itl.append(now - last)
            last = now
    stats.requests += 1


async def client_loop(
    index: int, base: str, deadline: float, args: argparse.Namespace, vocab_size: int
) -> ClientStats:
    rng = random.Random(args.seed * 1000 + index)
    stats = ClientStats()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        while time.perf_counter() < deadline:
            prompt_len = rng.randint(*args.prompt_len)
            body = {
                "model": MODEL_NAME,
                "prompt": [rng.randrange(3, vocab_size) for _ in range(prompt_len)],
                "max_tokens": rng.randint(*args.max_tokens),
                "ignore_eos": True,
                "stream": True,
                "temperature": 0.8,
                "seed": rng.randrange(2**31),
                "stream_options": {"include_usage": True},
            }
            try:
                await one_request(client, f"{base}/v1/completions", body, stats)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                stats.errors.append(f"{type(exc).__name__}: {exc}")
    return stats


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_clients(
    base: str, num_clients: int, args: argparse.Namespace, vocab_size: int
) -> tuple[list[ClientStats], float]:
    started = time.perf_counter()
    deadline = started + args.duration
    results = await asyncio.gather(
        *(client_loop(i, base, deadline, args, vocab_size) for i in range(num_clients))
    )
    return list(results), time.perf_counter() - started


def warm_up(base: str, vocab_size: int) -> None:
    """One long and one short request first: the first forward passes pay one-time costs
    (kernel compilation, allocator growth) that are no part of serving latency."""
    for prompt_len in (512, 8):
        body = {
            "model": MODEL_NAME,
            "prompt": [3 + i % (vocab_size - 3) for i in range(prompt_len)],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
        response.raise_for_status()


def blocks_back(base: str) -> bool:
    """True once /metrics shows no used block and no running or waiting request."""
    for _ in range(100):
        text = httpx.get(f"{base}/metrics", timeout=10).text
        values = dict(
            line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
        if all(
            float(values[k]) == 0
            for k in (
                "pagedkv_kv_blocks_used",
                "pagedkv_num_requests_running",
                "pagedkv_num_requests_waiting",
            )
        ):
            return True
        time.sleep(0.1)
    return False


def summarize(stats: list[ClientStats], elapsed: float, all_free: bool) -> dict[str, Any]:
    ttft = [x for s in stats for x in s.ttft]
    itl = [x for s in stats for x in s.itl]
    tokens = sum(s.output_tokens for s in stats)
    return {
        "requests": sum(s.requests for s in stats),
        "errors": sum(len(s.errors) for s in stats),
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "output_tok_per_s": tokens / elapsed,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else float("nan"),
        "all_blocks_back": all_free,
        "first_errors": [e for s in stats for e in s.errors][:5],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: random)")
    parser.add_argument(
        "--num-clients",
        type=int,
        nargs="+",
        default=[1, 16],
        help="one phase per value, against the same server (default: 1 then 16)",
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of new requests")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--max-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX")
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 then 4 clients, 8 s each")
    parser.add_argument("--out", default="bench_server", help="results file name")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_clients, args.duration = [1, 4], 8.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedkv.cli.demo import DEMO_MODEL_CONFIG
    from pagedkv.config import ModelConfig

    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        model_dir = Path(args.model) if args.model else _random_model(Path(tmp))
        vocab_size = ModelConfig.from_hf(model_dir).vocab_size
        port = free_port()
        server = start_server(model_dir, port, args)
        base = f"http://127.0.0.1:{port}"
        rows = []
        try:
            warm_up(base, vocab_size)
            for num_clients in args.num_clients:
                stats, elapsed = asyncio.run(run_clients(base, num_clients, args, vocab_size))
                rows.append({"clients": num_clients,
                             **summarize(stats, elapsed, blocks_back(base))})  # fmt: skip
        finally:
            server.terminate()
            server.wait(30)
    base_rate = rows[0]["output_tok_per_s"]
    for row in rows:
        row["throughput_vs_first"] = row["output_tok_per_s"] / base_rate
    print_table([{k: v for k, v in row.items() if k != "first_errors"} for row in rows])
    for error in (e for row in rows for e in row["first_errors"]):
        print("error:", error)
    config = {**vars(args), "model_config": None if args.model else DEMO_MODEL_CONFIG}
    print("wrote", write_results(args.out, config=config, results=rows))
    ok = all(row["errors"] == 0 and row["all_blocks_back"] for row in rows)
    return 0 if ok else 1


def _random_model(tmp: Path) -> Path:
    from pagedkv.cli.demo import DEMO_MODEL_CONFIG
    from pagedkv.models.loader import save_random_checkpoint

    return save_random_checkpoint(tmp / "model", DEMO_MODEL_CONFIG, seed=0)


if __name__ == "__main__":
    sys.exit(main())
