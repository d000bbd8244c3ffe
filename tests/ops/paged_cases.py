"""Shared test cases for every attention backend: builders and the parametrized grid.

A backend test calls `check_backend(backend, case_params)` over `ATTENTION_GRID`; the
expected output is the reference backend run in float64 on the same (rounded) inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedkv.ops import paged_attention
from pagedkv.ops.quantize import quantize


@dataclass
class Case:
    """One batch laid out in a paged cache with shuffled physical blocks."""

    query: torch.Tensor  # [num_tokens, H, D]
    key_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], -1 padded
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], contiguous copies
    values: list[torch.Tensor]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )

    def to(self, dtype: torch.dtype) -> Case:
        return Case(
            self.query.to(dtype),
            self.key_cache.to(dtype),
            self.value_cache.to(dtype),
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            [k.to(dtype) for k in self.keys],
            [v.to(dtype) for v in self.values],
        )


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
) -> Case:
    """Random batch; physical blocks shuffled, spare blocks filled with noise."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(needed) + 1
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, (n, nb) in enumerate(zip(seq_lens, needed, strict=True)):
        tables[s, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
        blocks = tables[s, :nb].long()
        keys.append(key_cache[blocks].flatten(0, 1)[:n].clone())
        values.append(value_cache[blocks].flatten(0, 1)[:n].clone())
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    case = Case(
        query,
        key_cache,
        value_cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
        keys,
        values,
    )
    case = case.to(dtype)
    if device != "cpu":
        case = Case(*(t.to(device) for t in case.args()), case.keys, case.values)
    return case


@dataclass
class Int8Case:
    """A case's caches quantized (`pagedkv.ops.quantize`), with their scales."""

    case: Case
    scales: dict[str, torch.Tensor]  # key_scales, value_scales [num_blocks, bs, Hkv] float16

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.case.args()


def quantized(case: Case) -> Int8Case:
    """`case` with its key and value pools held as int8 with a scale per token and head."""
    (key_cache, key_scales), (value_cache, value_scales) = (
        quantize(case.key_cache),
        quantize(case.value_cache),
    )
    q = Case(case.query, key_cache, value_cache, *case.args()[3:], case.keys, case.values)
    return Int8Case(q, {"key_scales": key_scales, "value_scales": value_scales})


def expected(case: Case | Int8Case, sliding_window: int | None = None) -> torch.Tensor:
    """The reference backend in float64 on the case's (already rounded) inputs, on the CPU;
    over an int8 case, on its dequantized caches."""
    scales = {k: t.cpu() for k, t in case.scales.items()} if isinstance(case, Int8Case) else {}
    args = [t.cpu() for t in case.args()]
    args[0] = args[0].double()
    if not scales:
        args[1], args[2] = args[1].double(), args[2].double()
    return paged_attention(*args, sliding_window=sliding_window, backend="reference", **scales)


def _mixed(bs: int) -> tuple[list[int], list[int]]:
    """Decode rows, a full prefill and chunked prefills at lengths 1, bs - 1, bs, bs + 1, long."""
    lens = [1, max(bs - 1, 1), bs, bs + 1, 3 * bs + 7, 2 * bs + 3, 70]
    queries = [1, 1, bs, 2, 3 * bs + 7, bs + 1, 1]
    return lens, queries


def _grid() -> list:
    params = []
    for bs in (1, 5, 16, 32, 128):
        for dtype in (torch.float32, torch.bfloat16):
            params.append(dict(bs=bs, h=8, hkv=2, d=64, dtype=dtype, window=None, mix=_mixed(bs)))
    for d in (32, 40, 64, 80, 128):
        for group in (1, 3, 4, 8):
            hkv = 2 if group < 8 else 1
            params.append(
                dict(
                    bs=16,
                    h=hkv * group,
                    hkv=hkv,
                    d=d,
                    dtype=torch.float32 if group % 2 else torch.bfloat16,
                    window=None,
                    mix=([1, 15, 17, 33], [1, 15, 2, 33]),
                )
            )
    for bs, window in ((5, 1), (5, 7), (16, 7), (16, 33), (32, 100)):
        params.append(
            dict(
                bs=bs,
                h=6,
                hkv=2,
                d=40,
                dtype=torch.float32,
                window=window,
                mix=([1, 40, 150, 9], [1, 40, 30, 3]),
            )
        )
    # Long decode rows are split across cores; multi-token decode rows (q_len 2..4).
    params.append(
        dict(
            bs=16,
            h=8,
            hkv=2,
            d=64,
            dtype=torch.float32,
            window=None,
            mix=([3000, 1300, 5, 2], [1, 4, 3, 2]),
        )
    )
    params.append(
        dict(bs=32, h=8, hkv=8, d=64, dtype=torch.bfloat16, window=300, mix=([2500, 700], [1, 2]))
    )
    return [
        pytest.param(
            p,
            id=f"bs{p['bs']}-h{p['h']}/{p['hkv']}-d{p['d']}-"
            f"{str(p['dtype'])[6:]}-w{p['window']}-{len(p['mix'][0])}seq",
        )
        for p in params
    ]


ATTENTION_GRID = _grid()


def check_backend(backend: str, p: dict, device: str = "cpu", int8: bool = False) -> None:
    """Run `backend` on grid case `p` and compare with the float64 reference (with `int8`,
    both on the case's caches quantized)."""
    lens, queries = p["mix"]
    case = make_case(
        lens,
        queries,
        block_size=p["bs"],
        num_heads=p["h"],
        num_kv_heads=p["hkv"],
        head_dim=p["d"],
        dtype=p["dtype"],
        device=device,
    )
    run: Case | Int8Case = quantized(case) if int8 else case
    scales = run.scales if isinstance(run, Int8Case) else {}
    out = paged_attention(*run.args(), sliding_window=p["window"], backend=backend, **scales)
    assert out.dtype == p["dtype"] and out.shape == case.query.shape
    tol = 1e-5 if p["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), expected(run, p["window"]), rtol=tol, atol=tol)
