"""llama.cpp as the anchor of `bench_latency.py`: GGUFs from the same Hugging Face directory
by its own converter, timed by its own `llama-batched-bench`. Nothing of llama.cpp lives in
this repository; pass the directory of a build's binaries. The converter needs the `gguf`
and `sentencepiece` packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    env = {k: v for k, v in os.environ.items() if k not in _WAIT_POLICY_VARIABLES}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
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
