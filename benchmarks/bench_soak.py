"""Memory over time: `pagedkv serve` held under a mixed load, its resident memory sampled.

Per dtype, starts `pagedkv serve` on 127.0.0.1 (or attaches to a running one: `--url` and
`--pid`) and runs `--num-clients` clients for `--duration` seconds or `--max-requests`
requests, whichever comes first. Each request is drawn from a seeded mix, as an operator's
traffic would be: chat (one of three shared system prompts, so the prefix cache is hit) or
completions (token-id prompts), prompts of 10-600 tokens (four in five under 100), 1-24 new tokens,
n = 2 one time in five, half of them streamed and a quarter of the streams closed after
their first chunks, sampled with a seed or greedy. Every request has a deadline
(`--deadline`); one that passes it is cancelled and counted.

The server's RSS (/proc/PID/status VmRSS) is sampled every `--sample-every` seconds. After
the warm-up (`--warmup`, the first 5 minutes by default) the check is: RSS stays within
`--rss-tolerance-mb` of its value at the end of the warm-up, no 5xx, no request over its
deadline. Reported: RSS at start, at the warm-up, at the end and after the load stops, the
largest drift after the warm-up, the slope after it (least squares, MB/min), latency
percentiles (all requests, time to first token of the streamed ones) and errors by kind.

    python benchmarks/bench_soak.py --quick                 # 3 minutes per dtype
    python benchmarks/bench_soak.py --duration 1800 --min-requests 5000
    python benchmarks/bench_soak.py --url http://127.0.0.1:8000 --pid PID --model M --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import launch_server, print_table, write_results
from bench_server import free_port, percentile

MODEL_NAME = "soak"
WORDS = (
    "the a cache block token memory request server model stream page table prefix engine "
    "river mountain garden window letter number question answer story morning evening city "
    "music colour paper light shadow bridge market signal pattern circle engine harbour"
).split()


@dataclass
class Tally:
    """What the clients saw; shared by all of them (one event loop, no locks needed)."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    over_deadline: int = 0
    transport_errors: int = 0
    stream_errors: int = 0
    closed_early: int = 0
    first_errors: list[str] = field(default_factory=list)

    def error(self, kind: str, text: str) -> None:
        if len(self.first_errors) < 5:
            self.first_errors.append(f"{kind}: {text[:200]}")

    @property
    def done(self) -> int:
        return sum(self.statuses.values()) + self.over_deadline + self.transport_errors


class RssSampler(threading.Thread):
    """Samples a process's resident memory every `every` seconds until `stop()`."""

    def __init__(self, pid: int, every: float, tally: Tally) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.tally = pid, every, tally
        self.samples: list[tuple[float, float, int]] = []  # (seconds, MB, requests done)
        self.started = time.monotonic()
        self._stopped = threading.Event()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def run(self) -> None:
        while not self._stopped.is_set():
            elapsed = time.monotonic() - self.started
            self.samples.append((elapsed, self.rss_mb(), self.tally.done))
            self._stopped.wait(self.every)

    def stop(self) -> None:
        self._stopped.set()
        self.join()


class Workload:
    """Seeded request bodies: the mix the module docstring describes."""

    def __init__(self, seed: int, vocab_size: int, has_tokenizer: bool) -> None:
        self.rng = random.Random(seed)
        self.vocab_size, self.has_tokenizer = vocab_size, has_tokenizer
        rng = random.Random(0)
        self.systems = [" ".join(rng.choices(WORDS, k=rng.randint(80, 250))) for _ in range(3)]

    def prompt_len(self) -> int:
        # Mostly short prompts, a tail up to 600: a 2-core machine still serves thousands.
        return self.rng.randint(10, 100) if self.rng.random() < 0.8 else self.rng.randint(100, 600)

    def draw(self) -> tuple[str, dict[str, Any], int | None]:
        """(path, body, chunks to read before closing a stream early or None)."""
        rng = self.rng
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "max_tokens": rng.randint(1, 24),
            "n": 2 if rng.random() < 0.2 else 1,
            "stream": rng.random() < 0.5,
        }
        if rng.random() < 0.5:
            body.update(temperature=0.8, seed=rng.randrange(2**31))
        else:
            body["temperature"] = 0.0
        if self.has_tokenizer and rng.random() < 0.5:
            path = "/v1/chat/completions"
            user = " ".join(rng.choices(WORDS, k=max(1, self.prompt_len() - 150)))
            body["messages"] = [
                {"role": "system", "content": rng.choice(self.systems)},
                {"role": "user", "content": user},
            ]
        else:
            path = "/v1/completions"
            body["prompt"] = [rng.randrange(3, self.vocab_size) for _ in range(self.prompt_len())]
            body["ignore_eos"] = True
        close_after = rng.randint(1, 3) if body["stream"] and rng.random() < 0.25 else None
        return path, body, close_after


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    close_after: int | None,
    tally: Tally,
) -> None:
    sent = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        status = response.status_code
        if status != 200:
            text = (await response.aread()).decode(errors="replace")
            tally.error(f"HTTP {status}", text)
        elif body["stream"]:
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if "error" in json.loads(line[6:]):
                    tally.stream_errors += 1
                    tally.error("stream", line)
                    break
                chunks += 1
                if chunks == 1:
                    tally.ttfts.append(time.perf_counter() - sent)
                if close_after is not None and chunks >= close_after:
                    tally.closed_early += 1
                    break  # leaving the block closes the connection mid-stream
        else:
            json.loads(await response.aread())
    tally.latencies.append(time.perf_counter() - sent)
    key = f"{status // 100}xx"
    tally.statuses[key] = tally.statuses.get(key, 0) + 1


async def client_loop(
    base: str, workload: Workload, stop_at: float, args: argparse.Namespace, tally: Tally
) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=args.deadline + 5, limits=limits) as client:
        while time.monotonic() < stop_at and tally.done < args.max_requests:
            path, body, close_after = workload.draw()
            try:
                await asyncio.wait_for(
                    one_request(client, base + path, body, close_after, tally), args.deadline
                )
            except TimeoutError:
                tally.over_deadline += 1
                tally.error("deadline", f"{path} over {args.deadline} s")
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                tally.transport_errors += 1
                tally.error(type(exc).__name__, str(exc))


async def run_load(base: str, workload: Workload, args: argparse.Namespace, tally: Tally) -> None:
    stop_at = time.monotonic() + args.duration
    await asyncio.gather(
        *(client_loop(base, workload, stop_at, args, tally) for _ in range(args.num_clients))
    )


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute (nan under 2 points)."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (m - mean_m) for t, m in points)
    return 60 * cov / var if var else float("nan")


def summarize(
    samples: list[tuple[float, float, int]], idle_rss: float, tally: Tally, args: argparse.Namespace
) -> dict[str, Any]:
    """One result row: RSS figures, the check, latency percentiles, error counts."""
    after = [(t, m) for t, m, _ in samples if t >= args.warmup]
    at_warmup = after[0][1] if after else float("nan")
    drift = max((abs(m - at_warmup) for _, m in after), default=float("nan"))
    five_xx = tally.statuses.get("5xx", 0)
    requests = tally.done
    ok = (
        bool(after)
        and drift <= args.rss_tolerance_mb
        and five_xx == 0
        and tally.over_deadline == 0
        and requests >= args.min_requests
    )
    return {
        "requests": requests,
        "elapsed_s": samples[-1][0] if samples else 0.0,
        "rss_start_mb": samples[0][1] if samples else float("nan"),
        "rss_warmup_mb": at_warmup,
        "rss_end_mb": samples[-1][1] if samples else float("nan"),
        "rss_idle_mb": idle_rss,
        "rss_drift_mb": drift,
        "rss_slope_mb_min": slope_mb_per_min(after),
        "latency_p50_s": percentile(tally.latencies, 50),
        "latency_p99_s": percentile(tally.latencies, 99),
        "latency_max_s": max(tally.latencies, default=float("nan")),
        "ttft_p50_s": percentile(tally.ttfts, 50),
        "ttft_p99_s": percentile(tally.ttfts, 99),
        "status_counts": dict(sorted(tally.statuses.items())),
        "5xx": five_xx,
        "over_deadline": tally.over_deadline,
        "transport_errors": tally.transport_errors,
        "stream_errors": tally.stream_errors,
        "streams_closed_early": tally.closed_early,
        "ok": ok,
        "first_errors": tally.first_errors,
        "rss_samples": [{"t_s": t, "rss_mb": m, "requests": r} for t, m, r in samples],
    }


def start_server(model: str, dtype: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    """`pagedkv serve` in a child process on 127.0.0.1; returns once /health answers."""
    serve_args = [
        "--model", model, "--dtype", dtype, "--device", "cpu", "--served-model-name", MODEL_NAME,
        "--max-num-seqs", str(args.max_num_seqs), "--num-blocks", str(args.num_blocks),
    ] + (["--no-token-buckets"] if args.no_token_buckets else [])  # fmt: skip
    return launch_server(serve_args, port)


def soak(base: str, pid: int, vocab_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run the load against the server at `base` (process `pid`); one result row."""
    has_tokenizer = (
        httpx.post(f"{base}/tokenize", json={"model": MODEL_NAME, "prompt": "a b"}, timeout=30)
        .status_code == 200
    )  # fmt: skip
    tally = Tally()
    sampler = RssSampler(pid, args.sample_every, tally)
    sampler.start()
    try:
        asyncio.run(run_load(base, Workload(args.seed, vocab_size, has_tokenizer), args, tally))
        time.sleep(args.sample_every)  # let the last responses' buffers go
    finally:
        sampler.stop()
    return {"chat": has_tokenizer, **summarize(sampler.samples, sampler.rss_mb(), tally, args)}


def default_model(tmp: Path) -> str:
    """SmolLM2-135M-Instruct's GGUF when installed, else a random model of its shape."""
    from pagedkv.cli.demo import find_demo_model
    from pagedkv.models.loader import save_random_checkpoint

    found = find_demo_model()
    if found is not None:
        return str(found)
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
    }  # fmt: skip
    return str(save_random_checkpoint(tmp / "model", config, seed=0))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--url", default=None, help="a running server (127.0.0.1 only)")
    parser.add_argument("--pid", type=int, default=None, help="its process id, for RSS")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--max-requests", type=int, default=50_000, help="stop after these")
    parser.add_argument("--min-requests", type=int, default=0, help="fewer fails the check")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before the check")
    parser.add_argument("--sample-every", type=float, default=10.0, help="RSS sample period")
    parser.add_argument("--rss-tolerance-mb", type=float, default=100.0)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--num-clients", type=int, default=12)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--no-token-buckets", action="store_true", help="serve without them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 minutes, 1 of warm-up")
    parser.add_argument("--out", default="bench_soak", help="results file name")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.sample_every = 180.0, 60.0, 5.0
    if args.url is not None:
        if args.pid is None or args.model is None or len(args.dtype) != 1:
            parser.error("--url needs --pid, --model (its vocabulary) and one --dtype")
        if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
            parser.error(f"--url: expected a server on 127.0.0.1, got {args.url}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedkv.config import ModelConfig

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        model = args.model or default_model(Path(tmp))
        vocab_size = ModelConfig.from_hf(model).vocab_size
        for dtype in args.dtype:
            if args.url is not None:
                rows.append({"dtype": dtype, **soak(args.url, args.pid, vocab_size, args)})
                continue
            port = free_port()
            server = start_server(model, dtype, port, args)
            try:
                result = soak(f"http://127.0.0.1:{port}", server.pid, vocab_size, args)
            finally:
                server.terminate()
                server.wait(60)
            rows.append({"dtype": dtype, **result})
    hidden = {"first_errors", "rss_samples", "status_counts"}
    print_table([{k: v for k, v in row.items() if k not in hidden} for row in rows])
    for error in (e for row in rows for e in row["first_errors"]):
        print("error:", error)
    print("wrote", write_results(args.out, config={**vars(args), "model": model}, results=rows))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
