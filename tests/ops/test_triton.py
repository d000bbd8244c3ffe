"""Triton backend against float64 references: under the interpreter on CPU, natively on CUDA.

Without a GPU the kernels run in Triton's interpreter, chosen by ``TRITON_INTERPRET=1``
when each ``@triton.jit`` function is *defined*, Triton's own ``tl.zeros`` & co. included.
So the variable must be set before anything imports triton:

- triton not imported yet (the usual case), or imported with the variable already 1:
  set it here, then import the backend.
- triton already imported without it (another test module imported it first): the
  interpreter would fail on Triton's own jit helpers, so every test here is skipped
  and `test_in_fresh_process` runs this file in a new process with the variable set.

The interpreter handles float32 and float16 only, so bfloat16 runs on CUDA alone.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
TRITON_PREIMPORTED = (
    not ON_GPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if not ON_GPU and not TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")


def _load_backend():
    """`pagedkv.ops.triton`, its kernels interpreted when there is no GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    package = importlib.import_module("pagedkv.ops.triton")
    decode = sys.modules["pagedkv.ops.triton.decode"]
    # Importing the backend imports triton, so it cannot have been imported before
    # triton unless TRITON_INTERPRET was already 1: the kernels are interpreted here.
    assert ON_GPU or isinstance(decode._decode_kernel, InterpretedFunction), "kernels compiled"
    return package


if not TRITON_PREIMPORTED:
    tops = _load_backend()
    decode_mod = sys.modules["pagedkv.ops.triton.decode"]

from paged_cases import ATTENTION_GRID, check_backend  # noqa: E402

from pagedkv.ops import (  # noqa: E402
    AttentionMetadata,
    paged_attention,
    paged_attention_from_metadata,
)
from pagedkv.ops import reference as ops_reference  # noqa: E402
from pagedkv.ops.quantize import quantize  # noqa: E402

in_process = pytest.mark.skipif(
    TRITON_PREIMPORTED,
    reason="triton was imported without TRITON_INTERPRET: see test_in_fresh_process",
)
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_batch(seq_lens, query_lens, *, block_size, num_kv_heads, group, head_dim, dtype,
               seed=0, poison=True):  # fmt: skip
    """Packed batch in a cache with shuffled blocks; unreferenced rows hold NaN when poisoned.

    A NaN reaches the output only if a kernel reads a row outside the sequences' keys
    (spare blocks, the tail of a last block), so poisoning checks every load mask.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(needed, default=0) + 1), -1, dtype=torch.int32)
    is_used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, needed, strict=True)):
        tables[s, :nb] = perm[used : used + nb].int()
        used += nb
        pos = torch.arange(n)
        is_used[tables[s, pos // block_size].long(), pos % block_size] = True
    if poison:
        key_cache[~is_used] = float("nan")
        value_cache[~is_used] = float("nan")
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_kv_heads * group, head_dim, generator=gen)
    args = [query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables,
            torch.tensor(seq_lens, dtype=torch.int32), starts]  # fmt: skip
    return [t.to(DEVICE) for t in args]


def dense_reference(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    scale, window=None):  # fmt: skip
    """float64: gather each sequence's K/V through its table, masked softmax, per sequence."""
    query, key_cache, value_cache = (t.cpu().double() for t in (query, key_cache, value_cache))
    block_tables, seq_lens, query_start_loc = (
        t.cpu().long() for t in (block_tables, seq_lens, query_start_loc))  # fmt: skip
    out = torch.zeros_like(query)
    group = query.shape[1] // key_cache.shape[2]
    block_size = key_cache.shape[1]
    for s in range(seq_lens.shape[0]):
        n, a, b = int(seq_lens[s]), int(query_start_loc[s]), int(query_start_loc[s + 1])
        pos = torch.arange(n)
        blocks = block_tables[s, pos // block_size]
        k = key_cache[blocks, pos % block_size].repeat_interleave(group, 1)  # (n, H, D)
        v = value_cache[blocks, pos % block_size].repeat_interleave(group, 1)
        q_pos = n - (b - a) + torch.arange(b - a)
        keep = pos[None, :] <= q_pos[:, None]
        if window is not None:
            keep &= pos[None, :] > q_pos[:, None] - window
        scores = torch.einsum("thd,khd->htk", query[a:b], k) * scale
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("htk,khd->thd", probs, v)
    return out


def assert_matches(out, scale, args, window=None):
    expected = dense_reference(*args, scale, window)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    err = (out.cpu().double() - expected).abs().max() / expected.abs().max()
    assert err < TOL[out.dtype], f"relative error {err:.2e} >= {TOL[out.dtype]}"


def run(args, window=None, scale=None):
    scale = scale if scale is not None else args[0].shape[-1] ** -0.5
    out = paged_attention(*args, scale=scale, sliding_window=window, backend="triton")
    return out, scale


# Each axis fully covered without the full product: (block_size, head_dim, group, dtype).
AXES = [
    (1, 32, 1, torch.float32),
    (5, 40, 3, torch.float32),
    (16, 64, 4, torch.float16),
    (32, 80, 8, torch.float32),
    (16, 128, 3, torch.float16),
    (128, 64, 8, torch.float16),
    (32, 128, 1, torch.float32),
]
AXIS_IDS = [f"bs{a}-d{b}-g{c}-{str(d)[6:]}" for a, b, c, d in AXES]


@in_process
@pytest.mark.parametrize("block_size,head_dim,group,dtype", AXES, ids=AXIS_IDS)
def test_decode(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    lens = sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 70})
    args = make_batch(lens, [1] * len(lens), block_size=block_size, num_kv_heads=2,
                      group=group, head_dim=head_dim, dtype=dtype)  # fmt: skip
    assert_matches(*run(args), args)


@in_process
@pytest.mark.parametrize("block_size,head_dim,group,dtype", AXES, ids=AXIS_IDS)
def test_prefill_and_mixed(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    # Full prefill, chunked prefill over a cached prefix, decode rows, length bs +/- 1.
    bs = block_size
    lens = [2 * bs + 9, bs + 1, 40, max(bs - 1, 1), 1]
    queries = [2 * bs + 9, min(3, bs + 1), 1, max(bs - 1, 1), 1]
    args = make_batch(lens, queries, block_size=bs, num_kv_heads=2, group=group,
                      head_dim=head_dim, dtype=dtype, seed=1)  # fmt: skip
    assert_matches(*run(args), args)


@in_process
def test_long_prompts_use_128_row_tiles() -> None:
    lens, queries = [150, 90], [150, 60]
    assert tops.prefill_block_m(torch.float16, sum(queries), 2, 2, 8) == 128
    args = make_batch(lens, queries, block_size=8, num_kv_heads=2, group=2, head_dim=40,
                      dtype=torch.float16, seed=2)  # fmt: skip
    assert_matches(*run(args, window=70), args, window=70)


@in_process
@pytest.mark.parametrize("window", [1, 4, 17, 100])
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "mixed"])
def test_sliding_window(window: int, is_decode: bool) -> None:
    lens = [3, 30, 90, 18]
    queries = [1] * 4 if is_decode else [3, 12, 1, 18]
    args = make_batch(lens, queries, block_size=8, num_kv_heads=2, group=2, head_dim=32,
                      dtype=torch.float32, seed=window)  # fmt: skip
    assert_matches(*run(args, window), args, window=window)


@in_process
@pytest.mark.parametrize("partition_size", [16, 32, 48, 1024])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_partitions(partition_size: int, window: int | None) -> None:
    """Any partition size: many partitions, empty ones (short rows), and none at all."""
    lens = [1, 15, 70, 203]
    args = make_batch(lens, [1] * 4, block_size=16, num_kv_heads=2, group=4, head_dim=64,
                      dtype=torch.float32, seed=7)  # fmt: skip
    out = decode_mod.decode_attention(
        *args, scale=0.125, sliding_window=window, max_span=args[3].shape[1] * 16,
        partition_size=partition_size, tile_blocks=1,
    )  # fmt: skip
    assert_matches(out, 0.125, args, window)


@in_process
@pytest.mark.parametrize("query_lens", [[0, 2, 1, 1], [1, 0, 3, 0]])
def test_sequences_without_new_tokens(query_lens: list[int]) -> None:
    # [0, 2, 1, 1] has num_tokens == num_seqs and so takes the decode route.
    lens = [9, 20, 33, 4]
    args = make_batch(lens, query_lens, block_size=5, num_kv_heads=1, group=4, head_dim=32,
                      dtype=torch.float32, seed=3)  # fmt: skip
    out, scale = run(args, window=6)
    assert_matches(out, scale, args, window=6)


@in_process
def test_from_metadata_routes_by_host_lengths() -> None:
    """max_query_len <= 1 takes the decode kernel even with rows of no new token."""
    lens, queries = [7, 40, 3, 61], [1, 0, 1, 1]
    args = make_batch(lens, queries, block_size=4, num_kv_heads=2, group=2, head_dim=32,
                      dtype=torch.float32, seed=5)  # fmt: skip
    tables = [[b for b in row if b >= 0] for row in args[3].tolist()]
    md = AttentionMetadata.build(tables, lens, queries, [-1] * sum(queries), device=DEVICE,
                                 backend="triton")  # fmt: skip
    assert md.max_query_len == 1
    out = paged_attention_from_metadata(*args[:3], md, scale=0.2, sliding_window=None)
    assert_matches(out, 0.2, args)


@in_process
@pytest.mark.parametrize("p", ATTENTION_GRID)
def test_shared_grid(p: dict) -> None:
    """The grid every backend runs (tests/ops/paged_cases.py); bf16 -> fp16 off-GPU."""
    if not ON_GPU and p["dtype"] == torch.bfloat16:
        p = {**p, "dtype": torch.float16}
    check_backend("triton", p, device=DEVICE)


INT8_GRID = [p for p in ATTENTION_GRID if p.values[0]["dtype"] == torch.float32]


@in_process
@pytest.mark.parametrize("p", INT8_GRID)
def test_shared_grid_int8(p: dict) -> None:
    """The grid's float32 cases over int8 caches with their scales, against the reference
    on the same int8 data."""
    check_backend("triton", p, device=DEVICE, int8=True)


@in_process
def test_write_kv_int8_quantizes_as_the_cpu() -> None:
    gen = torch.Generator().manual_seed(2)
    shape, heads, dim = (6, 5), 3, 40
    slots = torch.tensor([7, -1, 0, 29, 12, -5, 13])
    key = torch.randn(len(slots), heads, dim, generator=gen) * 3
    value = torch.randn(len(slots), heads, dim, generator=gen)
    key[2, 1] = 0.0
    caches = [torch.zeros(*shape, heads, dim, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    scales = [torch.zeros(*shape, heads, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    tops.write_kv(key.to(DEVICE), value.to(DEVICE), *caches, slots.to(DEVICE), tuple(scales))
    keep = slots >= 0
    for rows, cache, scale in zip((key, value), caches, scales, strict=True):
        data, want = quantize(rows[keep])
        assert torch.equal(scale.cpu().view(-1, heads)[slots[keep]], want)
        got = cache.cpu().view(-1, heads, dim)[slots[keep]]
        assert (got.int() - data.int()).abs().max() <= 1  # a division's rounding at most


@in_process
@pytest.mark.parametrize("query_lens", [[4, 1], [1, 1]], ids=["mixed", "decode"])
def test_strided_query(query_lens: list[int]) -> None:
    args = make_batch([20, 9], query_lens, block_size=4, num_kv_heads=2, group=2, head_dim=32,
                      dtype=torch.float32, seed=4)  # fmt: skip
    fused = torch.cat([args[0], torch.randn_like(args[0])], dim=1)  # like a fused QKV output
    args[0] = fused[:, : args[0].shape[1]]
    assert not args[0].is_contiguous()
    assert_matches(*run(args), args)


@in_process
@pytest.mark.parametrize("window", [None, 10])
def test_matches_ops_reference(window: int | None) -> None:
    args = make_batch([1, 17, 50], [1, 5, 50], block_size=16, num_kv_heads=2, group=3,
                      head_dim=40, dtype=torch.float32, seed=11, poison=False)  # fmt: skip
    out, scale = run(args, window)
    cpu = [t.cpu() for t in args]
    expected = ops_reference.paged_attention(*cpu, scale=scale, sliding_window=window)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_write_kv(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim = 6, 5, 3, 40
    key_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    value_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    slots = torch.tensor([7, -1, 0, 29, 12, -5, 13])
    key = torch.randn(len(slots), heads, dim, generator=gen)
    value = torch.randn(len(slots), heads, dim, generator=gen)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, heads, dim)[slots[keep]] = key[keep].to(cache_dtype)
    expected_v.view(-1, heads, dim)[slots[keep]] = value[keep].to(cache_dtype)
    caches = [key_cache.to(DEVICE), value_cache.to(DEVICE)]
    tops.write_kv(key.to(DEVICE), value.to(DEVICE), *caches, slots.to(DEVICE))
    assert torch.equal(caches[0].cpu(), expected_k) and torch.equal(caches[1].cpu(), expected_v)


@in_process
@pytest.mark.skipif(ON_GPU, reason="slots on a GPU are not read back to be checked")
def test_write_kv_rejects_slot_past_the_end_on_cpu_tensors() -> None:
    key_cache = torch.zeros(2, 4, 1, 8)
    key = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match=r"^slot_mapping: expected slots < .* = 8, got .*\[1\]"):
        tops.write_kv(key, key, key_cache, key_cache.clone(), torch.tensor([7, 8]))
    assert not key_cache.any(), "a row written before the bad slot was found"


@in_process
def test_rejects_caches_with_different_strides() -> None:
    args = make_batch([4], [1], block_size=4, num_kv_heads=2, group=1, head_dim=32,
                      dtype=torch.float32, poison=False)  # fmt: skip
    args[2] = args[2].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, HND strides
    with pytest.raises(ValueError, match="equal strides"):
        run(args)


@in_process
def test_partition_size_fills_the_gpu_only_when_needed() -> None:
    # batch 64 x 8 KV heads on 132 SMs: 2 partitions; batch 1 at 32K: the 64-partition cap.
    assert tops.choose_partition_size(64, 8, 4096, 64, 132) == 2048
    assert tops.choose_partition_size(1, 8, 32768, 64, 132) == 512
    assert tops.choose_partition_size(1, 8, 100, 80, 132) == 160  # one tile-aligned partition
    assert tops.choose_partition_size(4, 8, 0, 64, 132) == 64  # empty sequences only


@in_process
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_large(dtype: torch.dtype, block_size: int) -> None:
    """GQA 32/8, head_dim 128: long decode rows (split) and a long chunked prefill."""
    lens = [4096, 3000, 1, 777, 2048]
    for queries in ([1] * 5, [1, 600, 1, 777, 64]):
        args = make_batch(lens, queries, block_size=block_size, num_kv_heads=8, group=4,
                          head_dim=128, dtype=dtype, seed=block_size)  # fmt: skip
        for window in (None, 1000):
            assert_matches(*run(args, window), args, window=window)


def test_in_fresh_process() -> None:
    """This file in a new interpreter-mode process, when this one cannot interpret."""
    if not TRITON_PREIMPORTED:
        pytest.skip("this process runs the kernels itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x", "-p",
           "no:cacheprovider", "-k", "not test_in_fresh_process"]  # fmt: skip
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
