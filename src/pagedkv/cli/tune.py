"""`pagedkv tune`: measure this machine's CPU knobs and write them where every engine started
later reads them (`pagedkv.runtime.tuning`).

A short sweep, with the engine's own code on a small random model in each kernel dtype:

    matvec rows        r rows of a layer's product: the matrix-vector kernel against
                       oneDNN; the kernel keeps the rows up to the last r it wins
    tile rows          (bfloat16) r rows past those: the tiled kernel against oneDNN;
                       likewise
    fused decode rows  a decode step of r sequences: the compiled decoder stack against
                       the layers one by one; likewise

The other knobs keep their defaults. Each comparison alternates the two variants in one
process and takes medians (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MATVEC_CANDIDATES = (1, 2, 3, 4, 6, 8, 10, 12, 16)
TILE_CANDIDATES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
FUSED_CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32)
_MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 4, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 8192, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}  # fmt: skip
"""A few layers of SmolLM2-135M's shapes: small enough for a sweep of a minute or two."""
_HIDDEN, _INTERMEDIATE = _MODEL["hidden_size"], _MODEL["intermediate_size"]
_CONTEXT = 64  # tokens of each sequence before the timed decode step


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="measure this machine's CPU kernel settings and save them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed calls per variant and size (median)"
    )
    parser.add_argument(
        "--output", type=Path, default=None,
        help="the file to write (default: cpu-tuning.json in the cache directory)",
    )  # fmt: skip
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats: expected an int >= 1, got {args.repeats}")
    from pagedkv.runtime import kernel_cache

    kernel_cache.announce()  # before torch loads, so the line comes at once
    tuning = measure(args.repeats)
    path = tuning.save(args.output)
    for spec in dataclasses.fields(tuning):
        print(f"{spec.name:24} {getattr(tuning, spec.name)}")
    print(f"written to {path}")
    return 0


def measure(repeats: int) -> Any:
    """This machine's `CpuTuning`: the swept knobs measured, the others their defaults."""
    import torch

    from pagedkv.runtime.linear import can_pack
    from pagedkv.runtime.tuning import CpuTuning

    dtypes = [torch.float32]
    if can_pack(torch.bfloat16, torch.device("cpu")):
        dtypes.append(torch.bfloat16)
    rows = {dtype: matvec_rows(dtype, repeats) for dtype in dtypes}
    tuning = CpuTuning(
        matvec_rows_float32=rows[torch.float32],
        matvec_rows_bfloat16=rows.get(torch.bfloat16, CpuTuning().matvec_rows_bfloat16),
    )
    if torch.bfloat16 in rows:
        tiles = tile_rows(tuning, repeats)
        tuning = dataclasses.replace(tuning, tile_rows_bfloat16=tiles)
    fused = min(fused_decode_rows(dtype, tuning, repeats) for dtype in dtypes)
    return dataclasses.replace(tuning, fused_decode_rows=fused)


def last_win(candidates: Sequence[int], wins: Callable[[int], bool]) -> int:
    """The last candidate of the run of wins from the first (0 where the first loses)."""
    best = 0
    for candidate in candidates:
        if not wins(candidate):
            break
        best = candidate
    return best


def faster(first: Callable[[], Any], second: Callable[[], Any], repeats: int) -> bool:
    """Whether `first` takes at most `second`'s median time, the two timed alternately."""
    times: tuple[list[float], list[float]] = ([], [])
    for fn in (first, second):
        fn()  # warm
    for _ in range(repeats):
        for fn, out in zip((first, second), times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) <= statistics.median(times[1])


def matvec_rows(dtype: Any, repeats: int) -> int:
    """The matrix-vector kernel's rows on an MLP-sized product of `dtype` weights."""
    kernel, onednn = _mlp_layers(dtype)
    kernel.use_products(max(MATVEC_CANDIDATES), onednn=True)
    onednn.use_products(0, onednn=True)
    return last_win(MATVEC_CANDIDATES, _layer_wins(kernel, onednn, dtype, repeats))


def tile_rows(tuning: Any, repeats: int) -> int:
    """The tiled kernel's rows on an MLP-sized bfloat16 product, past `tuning`'s
    matrix-vector rows (0 where oneDNN wins from the first, or where the matrix-vector
    kernel takes no rows: layers use the tiled kernel only after it)."""
    import torch

    few = tuning.matvec_rows_bfloat16
    if few == 0:
        return 0
    tiled, onednn = _mlp_layers(torch.bfloat16)
    widest = dataclasses.replace(tuning, tile_rows_bfloat16=max(TILE_CANDIDATES))
    tiled.use_products(few, onednn=True, tuning=widest)
    onednn.use_products(few, onednn=True, tuning=dataclasses.replace(tuning, tile_rows_bfloat16=0))
    candidates = [rows for rows in TILE_CANDIDATES if rows > few]
    return last_win(candidates, _layer_wins(tiled, onednn, torch.bfloat16, repeats))


def _mlp_layers(dtype: Any) -> list[Any]:
    """Two `Linear` layers of an MLP's shape with the same random `dtype` weight."""
    import torch

    from pagedkv.runtime.linear import Linear

    layers = [Linear(_HIDDEN, 2 * _INTERMEDIATE, False, dtype=dtype) for _ in range(2)]
    for layer in layers:
        layer.weight.data.normal_(std=0.02, generator=torch.Generator().manual_seed(0))
    return layers


def _layer_wins(first: Any, second: Any, dtype: Any, repeats: int) -> Callable[[int], bool]:
    """rows -> whether `first` multiplies that many rows at most as slowly as `second`."""
    import torch

    def wins(rows: int) -> bool:
        x = torch.randn(rows, _HIDDEN).to(dtype)
        return faster(lambda: first.forward(x), lambda: second.forward(x), repeats)

    return wins


def fused_decode_rows(dtype: Any, tuning: Any, repeats: int) -> int:
    """The compiled decoder stack's rows on a small random model of `dtype`."""
    import torch

    from pagedkv.cache import PagedKVCache
    from pagedkv.models import load_model, save_random_checkpoint
    from pagedkv.ops import AttentionMetadata, plan

    name = str(dtype).removeprefix("torch.")
    widest = dataclasses.replace(tuning, fused_decode_rows=max(FUSED_CANDIDATES))
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(tmp, _MODEL, dtype=name)
        fused, layered = load_model(tmp, dtype=name), load_model(tmp, dtype=name)
    assert fused.use_cpu_runtime(tuning=widest), "a one-window model on the CPU"
    layered.use_cpu_runtime(fused_decode=False, tuning=tuning)
    config = fused.config
    blocks = -(-(_CONTEXT + 1) // 16)
    cache = PagedKVCache(config.num_layers, blocks * max(FUSED_CANDIDATES), 16,
                         config.num_kv_heads, config.head_dim, dtype=dtype)  # fmt: skip

    def wins(rows: int) -> bool:
        tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(rows)]
        slots = [table[_CONTEXT // 16] * 16 + _CONTEXT % 16 for table in tables]
        metadata = AttentionMetadata.build(tables, [_CONTEXT + 1] * rows, [1] * rows, slots)
        plan(metadata, cache.key_caches[0], cache.value_caches[0], config.num_heads)
        ids, positions = torch.ones(rows, dtype=torch.int64), torch.full((rows,), _CONTEXT)
        step = (ids, positions, cache, metadata, list(range(rows)))
        with torch.inference_mode():
            return faster(lambda: fused(*step), lambda: layered(*step), repeats)

    return last_win(FUSED_CANDIDATES, wins)
