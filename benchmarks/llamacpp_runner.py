"""llama.cpp as the anchor of `bench_latency.py`, `bench_engine.py`, `bench_perplexity.py`
and `bench_drift.py`: a GGUF given, or written from the same Hugging Face directory by its
own converter; latency timed by its own `llama-batched-bench`, throughput by its
`llama-server` answering concurrent HTTP requests, perplexity by its `llama-perplexity`,
next-token logprobs by its server. Nothing of llama.cpp lives in this repository; pass the
directory of a build's binaries. The converter needs the `gguf` and `sentencepiece` packages.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def find_converter(bin_dir: Path) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`, searched upwards from its build's bin/.

    Raises:
        FileNotFoundError: none found.
    """
    for parent in [bin_dir, *bin_dir.resolve().parents][:5]:
        candidate = parent / "convert_hf_to_gguf.py"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"convert_hf_to_gguf.py: expected above {bin_dir}, found none")


def convert(
    hf_dir: Path, out: Path, dtype: str, bin_dir: Path, converter: Path | None = None
) -> Path:
    """Write `hf_dir` as a GGUF of `dtype`'s type (F32, BF16, F16) with llama.cpp's converter.

    Raises:
        ValueError: a dtype llama.cpp's converter does not write unquantized.
        subprocess.CalledProcessError: the converter failed.
    """
    if dtype not in _OUTTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_OUTTYPES)}, got {dtype!r}")
    script = converter or find_converter(bin_dir)
    command = [sys.executable, str(script), str(hf_dir), "--outtype", _OUTTYPES[dtype],
               "--outfile", str(out)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def batched_bench(
    bin_dir: Path, gguf: Path, threads: int, prompt_len: int, new_tokens: int, batches: list[int]
) -> list[dict[str, Any]]:
    """One `llama-batched-bench` run: per batch size, TTFT and decode tokens/s.

    Flash attention off (its faster setting for short contexts on the CPU), prompt batch
    2048 / micro-batch 512, `threads` for both prompt and decode, and its OpenMP runtime's
    own thread policy: the wait-policy variables of this process (pagedkv's PASSIVE) are
    not passed on, since with workers asleep between tokens it decodes at half its speed.

    Returns:
        Per batch: {"batch", "ttft_s" (its prompt time), "decode_tokens_per_s"}.

    Raises:
        subprocess.CalledProcessError: the binary failed.
    """
    context = max(batches) * (prompt_len + new_tokens) + 64
    command = [
        str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(context),
        "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens),
        "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
        "-fa", "off", "--output-format", "jsonl",
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=_env())
    runs = []
    # Its log goes to stdout or stderr depending on the build's logger settings: read both.
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            runs.append({
                "batch": record["pl"],
                "ttft_s": record["t_pp"],
                "decode_tokens_per_s": record["speed_tg"],
            })  # fmt: skip
    if len(runs) != len(batches):
        raise RuntimeError(f"llama-batched-bench: expected {len(batches)} results, got:\n"
                           f"{done.stdout}\n{done.stderr[-2000:]}")  # fmt: skip
    return runs


def _env() -> dict[str, str]:
    """This environment less the wait-policy variables (see `batched_bench`)."""
    return {k: v for k, v in os.environ.items() if k not in _WAIT_POLICY_VARIABLES}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def server(bin_dir: Path, gguf: Path, threads: int, slots: int, slot_context: int) -> Iterator[str]:
    """A `llama-server` on `gguf` for the block: its base URL once it answers /health.

    `slots` sequences decode together (`-np`), each with `slot_context` tokens of KV
    (`-c` is their sum); flash attention off, the threads and thread policy as in
    `batched_bench`.

    Raises:
        RuntimeError: the server exited or did not come up within five minutes.
    """
    port = _free_port()
    command = [
        str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
        "--port", str(port), "-np", str(slots), "-c", str(slots * slot_context),
        "-t", str(threads), "-tb", str(threads), "-b", "2048", "-ub", "512", "-fa", "off",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=_env())  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url, deadline=time.monotonic() + 300)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_healthy(process: subprocess.Popen, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited:\n{process.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server: no answer on /health within five minutes")


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy `/completion` of token ids, EOS ignored, no prompt cache: its token ids."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True}  # fmt: skip
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=3600) as response:
        reply = json.load(response)
    if reply.get("tokens_predicted") != max_tokens:
        raise RuntimeError(f"llama-server: expected {max_tokens} tokens, got {reply!r:.500}")
    return list(reply.get("tokens") or [])


def next_logprobs(url: str, prompt: list[int], top: int) -> dict[int, float]:
    """The `top` most likely next tokens after `prompt` (token ids) and their logprobs, from
    the raw distribution (`/completion` with `n_probs`; the prompt cache on, so that
    consecutive prefixes of one sequence extend it)."""
    body = {"prompt": prompt, "n_predict": 1, "n_probs": top, "temperature": 0.0,
            "cache_prompt": True}  # fmt: skip
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    entries = reply["completion_probabilities"][0]["top_logprobs"]
    return {int(e["id"]): float(e["logprob"]) for e in entries}


def serve_concurrently(
    url: str, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[float, list[list[int]]]:
    """Send every request at once (one connection each): seconds until the last answer,
    and each request's token ids."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        start = time.perf_counter()
        tokens = list(pool.map(partial(complete, url), prompts, max_tokens))
        return time.perf_counter() - start, tokens


_FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_RUNNING_PPL = re.compile(r"\[(\d+)\]([0-9.]+),")


def perplexity(bin_dir: Path, gguf: Path, text: Path, n_ctx: int, threads: int) -> dict[str, Any]:
    """`llama-perplexity -m gguf -f text -c n_ctx -t threads`: its final PPL and error, and
    the running PPL it prints after each window.

    Raises:
        subprocess.CalledProcessError: the binary failed.
        RuntimeError: no final estimate in its output.
    """
    command = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text),
               "-c", str(n_ctx), "-t", str(threads)]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=_env())
    return parse_perplexity(done.stdout + done.stderr)


def dequantize(bin_dir: Path, gguf: Path, out: Path) -> Path:
    """Write `gguf` with every tensor in F32 (`llama-quantize --allow-requantize ... F32`):
    the same weights, which llama.cpp then multiplies without quantizing the activations.

    Raises:
        subprocess.CalledProcessError: the binary failed.
    """
    command = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), "F32"]
    subprocess.run(command, check=True, capture_output=True, text=True, env=_env())
    return out


def parse_perplexity(log: str) -> dict[str, Any]:
    """The figures of a `llama-perplexity` log: {"ppl", "err", "running": [per window]}.

    Raises:
        RuntimeError: the log holds no final estimate.
    """
    final = _FINAL_PPL.search(log)
    if final is None:
        raise RuntimeError(f"llama-perplexity: expected a final estimate, got:\n{log[-2000:]}")
    running = [float(value) for _, value in _RUNNING_PPL.findall(log)]
    return {"ppl": float(final.group(1)), "err": float(final.group(2)), "running": running}
