"""End-to-end engine throughput against transformers on the same model, prompts and machine.

A ~125M-parameter random Llama (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate
2048, vocab 32000), float32 and bfloat16, 32 seeded prompts of 32-512 tokens, greedy with EOS
ignored. Workloads: *fixed* (64 new tokens each), *variable* (16-256 new tokens per
request, the serving case) and *long* (8 prompts of 4,096 tokens, 128 new tokens each:
attention is a large share of each decode step). In the same run:

- pagedkv `LLM`'s engine (continuous batching, chunked prefill, paged attention);
- transformers' static `generate`: prompts sorted by length, batches of 8 (left padded),
  each batch decoding until its longest request is done (only requested tokens count);
- transformers' continuous batching: its manager's `add_request` with per-request
  `max_new_tokens` (`generate_batch` takes only one for all).

Efficiency is the matmul floor over the measured time: (prompt + output tokens) x 2 x the
layers' matmul parameters, plus output tokens x 2 x the LM head's, over the best matmul rate
measured in this run at the model's MLP shapes (torch's, or oneDNN's where the engine uses
it). Beside it, for pagedkv: its matmuls alone, timed in isolation at the token counts of the
steps it actually ran (`isolated_mm_seconds`), which bounds the efficiency any schedule of
those steps could reach. First dtype only: memory pressure (pool at ~30 % of the workload's
blocks), recompute vs swap; parallel sampling (n = 4, seeded) vs the same samples as
separate requests without prefix caching (peak blocks, throughput).

Threads: this machine has 2 cores, shared. Every run uses 2 torch threads (`--threads`),
1 inter-op thread, as many Numba threads, and OMP_WAIT_POLICY=PASSIVE, set before torch
loads: spinning OpenMP waits stall every 2-thread system whenever another process holds a core.

    python benchmarks/bench_engine.py --quick          # tiny model: a smoke run
    python benchmarks/bench_engine.py                  # full: long (tens of minutes)
    python benchmarks/bench_engine.py --dtype float32 --workload fixed --skip-hf
    python benchmarks/bench_engine.py --tensor-parallel-size 2 --skip-hf   # + 2 processes

With `--tensor-parallel-size N` each workload also runs on pagedkv split over N processes
(gloo), the machine's threads shared between them, beside the one-process run.

With `--gguf FILE` the model is that file (pagedkv loads it in each dtype; transformers,
which needs a Hugging Face directory, is skipped), and with `--llama-cpp-bin DIR` (a llama.cpp
build's bin/) each workload also runs on llama.cpp's `llama-server` on the same file with the
same threads: one slot per request (`-np`), every request sent at once over HTTP, greedy,
EOS ignored (`llamacpp_runner.server`).

    python benchmarks/bench_engine.py --gguf model.Q4_1.gguf --llama-cpp-bin ~/llama.cpp/build/bin
"""

from __future__ import annotations

import os

# Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import llamacpp_runner  # noqa: E402 (benchmarks/ is on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import print_table, set_threads, write_results  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.config import ModelConfig  # noqa: E402
from pagedkv.models import save_random_checkpoint  # noqa: E402
from pagedkv.runtime.linear import onednn_linear  # noqa: E402

FULL_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
QUICK_MODEL = {
    **FULL_MODEL,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 2048,
}
BLOCK_SIZE = 16
Tokens = list[list[list[int]]]  # per request, per sample, the generated ids


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def blocks(self, block_size: int = BLOCK_SIZE) -> list[int]:
        """Per request, the blocks its prompt and output fill."""
        pairs = zip(self.prompts, self.max_tokens, strict=True)
        return [-(-(len(p) + t) // block_size) for p, t in pairs]

    def repeated(self, n: int) -> Workload:
        """Each request n times in a row."""
        return Workload(
            f"{self.name}x{n}",
            [p for p in self.prompts for _ in range(n)],
            [t for t in self.max_tokens for _ in range(n)],
        )


def make_workloads(vocab_size: int, *, quick: bool, seed: int = 0) -> dict[str, Workload]:
    """Seeded prompts (ids avoid the special tokens 0-2) and per-request output lengths."""
    rng = random.Random(seed)
    num, low, high = (8, 8, 64) if quick else (32, 32, 512)
    lengths = [rng.randint(low, high) for _ in range(num)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]
    variable = [rng.randint(4, 32) if quick else rng.randint(16, 256) for _ in prompts]
    num_long, long_len, long_new = (2, 256, 16) if quick else (8, 4096, 128)
    long = [[rng.randrange(3, vocab_size) for _ in range(long_len)] for _ in range(num_long)]
    loads = {
        "fixed": Workload("fixed", prompts, [8 if quick else 64] * num),
        "variable": Workload("variable", prompts, variable),
        # Attention a large share of each decode step: few sequences with long contexts.
        "long": Workload("long", long, [long_new] * num_long),
    }
    for users in CONCURRENT_USERS:
        loads[f"users{users}"] = concurrent_users(vocab_size, users, quick=quick, seed=seed)
    return loads


CONCURRENT_USERS = (8, 32)


def concurrent_users(vocab_size: int, users: int, *, quick: bool, seed: int = 0) -> Workload:
    """`users` requests sent at once, as a chat server sees them: prompts of 32-384 tokens
    (8-64 with `quick`), 32 new tokens each (8 with `quick`)."""
    rng = random.Random(seed + users)
    low, high, new = (8, 64, 8) if quick else (32, 384, 32)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(low, high))] for _ in range(users)
    ]
    return Workload(f"users{users}", prompts, [new] * users)


def matmul_parameters(config: ModelConfig) -> tuple[int, int]:
    """(matmul parameters of all layers, of the LM head): what each token multiplies by."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return config.num_layers * (2 * h * q + 2 * h * kv + 3 * h * inter), h * config.vocab_size


def matmul_kernels(dtype: torch.dtype) -> list:
    """`F.linear` and, on a CPU with oneDNN, oneDNN's linear on the same plain weight (what
    the engine's float32 matmuls call, `pack_weights`; torch's float32 `F.linear` is MKL's,
    slower on AMD CPUs): the floor takes the faster."""
    kernels = [F.linear]
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        kernels.append(onednn_linear)
    return kernels


def measure_mm_rate(config: ModelConfig, dtype: torch.dtype, rows: int = 256) -> float:
    """Best FLOP/s over 1 s per kernel of `matmul_kernels` at the model's MLP shapes (`rows`
    tokens)."""
    h, inter = config.hidden_size, config.intermediate_size
    a, b = torch.randn(rows, h, dtype=dtype), torch.randn(inter, h, dtype=dtype)
    c, d = torch.randn(rows, inter, dtype=dtype), torch.randn(h, inter, dtype=dtype)
    best = float("inf")
    for kernel in matmul_kernels(dtype):
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            t0 = time.perf_counter()
            kernel(a, b), kernel(c, d)
            best = min(best, time.perf_counter() - t0)
    return 4 * rows * h * inter / best


def floor_seconds(workload: Workload, config: ModelConfig, mm_rate: float) -> float:
    """The time the workload's matmuls alone take at the measured rate."""
    layers, head = matmul_parameters(config)
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    return (tokens * 2 * layers + workload.num_output_tokens * 2 * head) / mm_rate


def isolated_mm_seconds(
    config: ModelConfig, dtype: torch.dtype, step_tokens: list[int], logit_rows: list[int]
) -> float:
    """Seconds the matmuls of the engine's own steps take alone: each step's linears, layer
    after layer with every layer's own weights (as the model streams them from memory), and
    its LM-head rows, timed at that step's token count with the engine's matmul (the last of
    `matmul_kernels`); best of 2 after a warm-up, per distinct token count.

    The floor above prices every matmul at the best rate of a 256-row GEMM; a decode step of
    32 sequences multiplies 32 rows, which no GEMM runs at that rate, and re-reads all the
    weights (more than the L3 cache in float32). This is the matmul time of the schedule the
    engine actually ran, with nothing else in between: the bound on its floor efficiency
    were attention, norms, sampling and Python free.
    """
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer_shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]  # (in, out)
    layers = [
        [torch.randn(out, inp, dtype=dtype) for inp, out in layer_shapes]
        for _ in range(config.num_layers)
    ]
    head = torch.randn(config.vocab_size, h, dtype=dtype)

    kernel = matmul_kernels(dtype)[-1]  # the engine's own

    def best_time(rows: int, weights: list[list[torch.Tensor]]) -> float:
        inputs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights[0]]
        best = float("inf")
        for _ in range(3):  # the first one warms up
            t0 = time.perf_counter()
            for layer in weights:
                for x, w in zip(inputs, layer, strict=True):
                    kernel(x, w)
            best = min(best, time.perf_counter() - t0)
        return best

    total = 0.0
    for rows, count in Counter(step_tokens).items():
        total += count * best_time(rows, layers)
    for rows, count in Counter(logit_rows).items():
        total += count * best_time(rows, [[head]])
    return total


def run_pagedkv(
    model_dir: Path,
    dtype: str,
    workload: Workload,
    *,
    n: int = 1,
    sample: bool = False,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Time the engine on the workload; peak blocks in use read after every step.

    Also returns each step's token count and LM-head rows (`step_tokens`, `logit_rows`),
    recorded by wrapping the model's two entry points (a list append per step).
    """
    llm_kwargs.setdefault("num_blocks", n * sum(workload.blocks()) + 64)
    llm = LLM(str(model_dir), dtype=dtype, block_size=BLOCK_SIZE, seed=0, **llm_kwargs)
    warm = SamplingParams(temperature=0.0, max_tokens=2)  # compiles the kernels
    llm.generate([{"prompt_token_ids": workload.prompts[0][:8]}], warm, use_tqdm=False)
    engine = llm.engine
    model = engine.runner.model
    step_tokens: list[int] = []
    logit_rows: list[int] = []
    forward, compute_logits = model.forward, model.compute_logits

    def recording_forward(input_ids: torch.Tensor, *args: Any) -> Any:
        step_tokens.append(input_ids.shape[0])
        if len(args) > 3 and args[3] is not None:  # the sampled rows' logits come with it
            logit_rows.append(len(args[3]))
        return forward(input_ids, *args)

    def recording_logits(hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        logit_rows.append(hidden.shape[0] if rows is None else len(rows))
        # older commits' runners pass the rows' hidden states only (compare_commits.py)
        return compute_logits(hidden) if rows is None else compute_logits(hidden, rows)

    model.forward, model.compute_logits = recording_forward, recording_logits
    for i, (prompt, max_tokens) in enumerate(
        zip(workload.prompts, workload.max_tokens, strict=True)
    ):
        params = SamplingParams(
            n=n, temperature=1.0 if sample else 0.0, seed=i, max_tokens=max_tokens, ignore_eos=True
        )
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[list[int]]] = {}
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
        peak = max(peak, engine.stats()["num_used_blocks"])
    seconds = time.perf_counter() - start
    tokens = [outputs[f"r{i}"] for i in range(len(workload.prompts))]
    assert sum(len(t) for ts in tokens for t in ts) == n * workload.num_output_tokens
    stats = engine.stats()
    keys = (
        "num_blocks",
        "num_preemptions",
        "num_swapped_out",
        "num_cow_copies",
        "prefix_cache_hits",
    )
    model.forward, model.compute_logits = forward, compute_logits
    llm.close()
    return {
        "seconds": seconds,
        "tokens": tokens,
        "peak_used_blocks": peak,
        "step_tokens": step_tokens,
        "logit_rows": logit_rows,
        **{key: stats[key] for key in keys},
    }


def run_hf_static(model: Any, workload: Workload, batch_size: int = 8) -> dict[str, Any]:
    """transformers `generate`: prompts sorted by length, left-padded batches of 8."""
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    tokens: dict[int, list[int]] = {}
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        width = max(len(workload.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for row, i in enumerate(batch):
            prompt = workload.prompts[i]
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(workload.max_tokens[i] for i in batch)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )
        for row, i in enumerate(batch):
            tokens[i] = out[row, width : width + workload.max_tokens[i]].tolist()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [[tokens[i]] for i in range(len(order))]}


def run_hf_continuous(
    model: Any, workload: Workload, max_batch_tokens: int | None
) -> dict[str, Any]:
    """transformers' continuous batching manager, one `add_request` per prompt."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Its pool sized to the workload (pages of 256 tokens): its attention mask grows with it.
    need = sum(workload.blocks(256)) + 2
    cb_config = ContinuousBatchingConfig(num_blocks=need, max_batch_tokens=max_batch_tokens)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(workload.max_tokens), eos_token_id=-1, pad_token_id=0
    )
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=gen,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        warmup=False,
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, new) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new, eos_token_id=-1)
        while len(results) < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        seconds = time.perf_counter() - start
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"transformers' continuous batching failed: {errors[0]}")
    tokens = [[results[f"r{i}"].generated_tokens] for i in range(len(workload.prompts))]
    return {"seconds": seconds, "tokens": tokens}


def run_pressure(
    model_dir: Path,
    dtype: str,
    workload: Workload,
    config: ModelConfig,
    share: float = 0.3,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Recompute vs swap with the pool at `share` of the workload's blocks."""
    need = sum(workload.blocks())
    num_blocks = max(int(need * share), max(workload.blocks()) + 1)
    element_bytes = torch.finfo(getattr(torch, dtype)).bits // 8
    swap_space = need * BLOCK_SIZE * config.kv_bytes_per_token(element_bytes)
    runs = {}
    for mode, swap in (("recompute", 0), ("swap", swap_space)):
        runs[mode] = run_pagedkv(
            model_dir,
            dtype,
            workload,
            num_blocks=num_blocks,
            preemption_mode=mode,
            swap_space=swap,
            **llm_kwargs,
        )
    # Greedy outputs do not depend on preemption: both modes must agree token for token.
    same = _agreement(runs["recompute"]["tokens"], runs["swap"]["tokens"])
    return {"num_blocks": num_blocks, "workload_blocks": need, "runs": runs,
            "same_tokens_recompute_swap": same}  # fmt: skip


def run_parallel(
    model_dir: Path, dtype: str, workload: Workload, n: int = 4, **llm_kwargs: Any
) -> dict[str, Any]:
    """n seeded samples per prompt: one request forked n ways vs n separate requests."""
    shared = run_pagedkv(model_dir, dtype, workload, n=n, sample=True, **llm_kwargs)
    separate = run_pagedkv(
        model_dir,
        dtype,
        workload.repeated(n),
        sample=True,
        enable_prefix_caching=False,
        **llm_kwargs,
    )
    saved = separate["peak_used_blocks"] - shared["peak_used_blocks"]
    return {"n": n, "shared": shared, "separate": separate, "blocks_saved": saved}


def bench_throughput(
    args: argparse.Namespace,
    model_dir: Path,
    config: ModelConfig,
    dtype: str,
    workloads: dict[str, Workload],
) -> list[dict[str, Any]]:
    """pagedkv vs transformers (static, continuous) on each workload, in one dtype."""
    torch_dtype = getattr(torch, dtype)
    mm_rate = measure_mm_rate(config, torch_dtype)
    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    rows: list[dict[str, Any]] = []
    for name, workload in workloads.items():
        floor = floor_seconds(workload, config, mm_rate)
        runs = {"pagedkv": run_pagedkv(model_dir, dtype, workload, **_engine_kwargs(args))}
        ours = runs["pagedkv"]
        tp = args.tensor_parallel_size
        if tp > 1:
            runs[f"pagedkv tp {tp}"] = run_pagedkv(
                model_dir, dtype, workload, tensor_parallel_size=tp, **_engine_kwargs(args)
            )
        mm_alone = (
            float("nan")
            if args.skip_bound
            else isolated_mm_seconds(config, torch_dtype, ours["step_tokens"], ours["logit_rows"])
        )
        print(
            f"  {dtype:8s} {name:8s} pagedkv's {len(ours['step_tokens'])} steps: matmuls alone "
            f"{mm_alone:.2f} s at their own shapes (floor {floor:.2f} s): efficiency bound "
            f"{floor / mm_alone:.2f} with nothing but matmuls",
            flush=True,
        )
        if args.llama_cpp is not None:
            runs["llama.cpp server"] = run_llamacpp_server(args, workload)
        if hf_model is not None:
            runs["hf_static"] = run_hf_static(hf_model, workload)
            runs["hf_continuous"] = run_hf_continuous(hf_model, workload, args.hf_max_batch_tokens)
        for system, run in runs.items():
            row = {
                "dtype": dtype,
                "workload": name,
                "system": system,
                "seconds": run["seconds"],
                "tokens_per_s": workload.num_output_tokens / run["seconds"],
                "floor_seconds": floor,
                "floor_efficiency": floor / run["seconds"],
                "pagedkv_mm_alone_seconds": mm_alone,
                "mm_gflops": mm_rate / 1e9,
                "pagedkv_speedup": runs["pagedkv"]["seconds"] ** -1 * run["seconds"],
                "same_tokens_as_pagedkv": _agreement(runs["pagedkv"]["tokens"], run["tokens"]),
            }
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows


def run_llamacpp_server(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """The workload on `llama-server` (one slot per request, all sent at once), timed from
    the first request sent to the last answer, after one untimed request."""
    slot_context = max(
        len(p) + m for p, m in zip(workload.prompts, workload.max_tokens, strict=True)
    )
    slots = len(workload.prompts)
    with llamacpp_runner.server(
        args.llama_cpp, args.gguf, args.threads, slots, slot_context + 16
    ) as url:
        llamacpp_runner.complete(url, workload.prompts[0][:8], 2)
        seconds, tokens = llamacpp_runner.serve_concurrently(
            url, workload.prompts, workload.max_tokens
        )
    return {"seconds": seconds, "tokens": [[t] for t in tokens]}


def _agreement(ours: Tokens, theirs: Tokens) -> float:
    """Share of requests with identical greedy tokens (near-ties make a few differ)."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"attention_backend": args.attention_backend}


def _format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['dtype']:>9} {row['workload']:>9} {row['system']:>14} "
        f"{row['seconds']:8.2f} s {row['tokens_per_s']:8.1f} tok/s  "
        f"pagedkv x{row['pagedkv_speedup']:5.2f}  floor {row['floor_efficiency']:5.2f}  "
        f"same tokens {row['same_tokens_as_pagedkv']:4.0%}"
    )


def _print_pressure(pressure: dict[str, Any], workload: Workload) -> None:
    print(
        f"memory pressure ({workload.name}): {pressure['num_blocks']} blocks for a workload "
        f"of {pressure['workload_blocks']}"
    )
    for mode, run in pressure["runs"].items():
        print(
            f"  {mode:>9}: {workload.num_output_tokens / run['seconds']:8.1f} tok/s, "
            f"{run['num_preemptions']} preemptions, {run['num_swapped_out']} swapped out"
        )
    print(f"  same tokens in both modes: {pressure['same_tokens_recompute_swap']:.0%}")


def _print_parallel(parallel: dict[str, Any], workload: Workload) -> None:
    print(f"parallel sampling ({workload.name}, n={parallel['n']}):")
    for kind in ("shared", "separate"):
        run = parallel[kind]
        rate = parallel["n"] * workload.num_output_tokens / run["seconds"]
        print(f"  {kind:>8}: peak {run['peak_used_blocks']} blocks, {rate:8.1f} tok/s")
    print(f"  blocks saved by sharing: {parallel['blocks_saved']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and workload")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument(
        "--workload",
        choices=["fixed", "variable", "long", "users", "both", "all"],
        default="both",
        help="fixed: 32 prompts of 32-512 tokens, 64 new each; variable: the same prompts, "
        "16-256 new; long: 8 prompts of 4,096 tokens, 128 new; users: 8, then 32 requests "
        "sent at once, prompts of 32-384 tokens, 32 new each; both: fixed and variable",
    )
    parser.add_argument("--skip-hf", action="store_true", help="pagedkv runs only")
    parser.add_argument("--skip-pressure", action="store_true")
    parser.add_argument("--skip-parallel", action="store_true")
    parser.add_argument(
        "--skip-bound", action="store_true", help="skip timing the steps' matmuls alone"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="also run pagedkv split over N processes (the threads shared between them)",
    )
    parser.add_argument("--attention-backend", default="auto", help="pagedkv's attention ops")
    parser.add_argument(
        "--hf-max-batch-tokens",
        type=int,
        default=None,
        help="transformers' continuous batching token budget",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="reuse this random checkpoint (written there if missing)",
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="this GGUF file as the model (no transformers)"
    )
    parser.add_argument(
        "--llama-cpp-bin",
        dest="llama_cpp",
        type=Path,
        default=None,
        metavar="BIN_DIR",
        help="llama.cpp's build/bin: its llama-server runs the --gguf file alongside",
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    if args.llama_cpp is not None and args.gguf is None:
        parser.error("--llama-cpp-bin: expected --gguf FILE too (llama.cpp runs that file)")
    args.skip_hf |= args.gguf is not None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    hf_config = QUICK_MODEL if args.quick else FULL_MODEL
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.gguf or args.model_dir or Path(tmp) / "model"
        if args.gguf is None and not (model_dir / "config.json").exists():
            save_random_checkpoint(model_dir, hf_config, seed=0)
        config = ModelConfig.from_hf(model_dir)
        workloads = make_workloads(config.vocab_size, quick=args.quick)
        if args.workload == "both":
            workloads = {k: workloads[k] for k in ("fixed", "variable")}
        elif args.workload == "users":
            workloads = {f"users{n}": workloads[f"users{n}"] for n in CONCURRENT_USERS}
        elif args.workload != "all":
            workloads = {args.workload: workloads[args.workload]}
        results: dict[str, Any] = {"throughput": []}
        for dtype in dtypes:
            results["throughput"] += bench_throughput(args, model_dir, config, dtype, workloads)
        first = next(iter(workloads.values()))
        # Memory pressure and sharing, first dtype only: pressure on the serving case, sharing
        # on half the prompts (n = 4 quadruples the decode work).
        pressure_load = workloads.get("variable") or workloads.get("fixed") or first
        if not args.skip_pressure:
            pressure = run_pressure(
                model_dir, dtypes[0], pressure_load, config, **_engine_kwargs(args)
            )
            _print_pressure(pressure, pressure_load)
            results["pressure"] = pressure
        if not args.skip_parallel:
            load = workloads.get("fixed") or pressure_load
            half = Workload(load.name, load.prompts[::2], load.max_tokens[::2])
            parallel = run_parallel(model_dir, dtypes[0], half, **_engine_kwargs(args))
            _print_parallel(parallel, half)
            results["parallel"] = parallel
    columns = ["dtype", "workload", "system", "seconds", "tokens_per_s", "pagedkv_speedup",
               "floor_efficiency", "same_tokens_as_pagedkv"]  # fmt: skip
    print_table(results["throughput"], columns)
    _write(args, hf_config, workloads, results)


def _write(
    args: argparse.Namespace,
    hf_config: dict[str, Any],
    workloads: dict[str, Workload],
    results: dict[str, Any],
) -> None:
    """Write the figures (not the token lists) with the config and the environment."""
    for run in [
        *results.get("pressure", {}).get("runs", {}).values(),
        *(results["parallel"][k] for k in ("shared", "separate") if "parallel" in results),
    ]:
        run.pop("tokens", None)
    config = {
        "model": str(args.gguf) if args.gguf is not None else hf_config,
        "llama_cpp_bin": None if args.llama_cpp is None else str(args.llama_cpp),
        "quick": args.quick,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "block_size": BLOCK_SIZE,
        "attention_backend": args.attention_backend,
        "hf_max_batch_tokens": args.hf_max_batch_tokens,
        "workloads": {
            name: {
                "num_prompts": len(w.prompts),
                "prompt_tokens": w.num_prompt_tokens,
                "output_tokens": w.num_output_tokens,
            }
            for name, w in workloads.items()
        },
    }
    name = "bench_engine_quick" if args.quick else "bench_engine"
    out_dir = None
    if args.output is not None:
        name, out_dir = args.output.stem, args.output.parent
    path = write_results(name, config=config, results=results, out_dir=out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
