"""Every CPU backend over the shared grid; the reference itself against dense SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_cases import ATTENTION_GRID, check_backend, expected, make_case

from pagedkv.ops import (
    AttentionMetadata,
    cpu,
    paged_attention,
    paged_attention_from_metadata,
    plan,
)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("p", ATTENTION_GRID)
def test_backend_matches_float64_reference(backend: str, p: dict) -> None:
    check_backend(backend, p)


def _dense_sdpa(case, window: int | None) -> torch.Tensor:
    """Each sequence alone, KV contiguous, explicit bottom-right causal (+ window) mask."""
    outs = []
    starts = case.query_start_loc.tolist()
    group = case.query.shape[1] // case.key_cache.shape[2]
    for s, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.query[starts[s] : starts[s + 1]].double().transpose(0, 1)  # (H, q, D)
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_len, n = q.shape[1], k.shape[1]
        pos = torch.arange(n - q_len, n)[:, None]
        keys = torch.arange(n)[None, :]
        mask = (keys <= pos) & ((keys > pos - window) if window else True)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("bs,group", [(1, 1), (5, 3), (16, 4)])
def test_reference_matches_dense_sdpa(bs: int, group: int, window: int | None) -> None:
    case = make_case(
        [1, 4, 16, 17, 40],
        [1, 4, 2, 17, 23],
        block_size=bs,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=32,
        seed=bs,
    )
    torch.testing.assert_close(
        expected(case, window), _dense_sdpa(case, window), rtol=1e-12, atol=1e-12
    )


def test_scale_and_prefix_positions() -> None:
    """A custom scale is applied, and a chunk over a cached prefix sees the whole prefix."""
    case = make_case([50], [10], block_size=16, num_heads=4, num_kv_heads=4, head_dim=32)
    out = paged_attention(*case.args(), scale=0.3, backend="cpu")
    q = case.query.transpose(0, 1)[None]
    k, v = case.keys[0].transpose(0, 1)[None], case.values[0].transpose(0, 1)[None]
    mask = torch.ones(10, 50, dtype=torch.bool).tril(40)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)[0].transpose(0, 1)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_empty_query_sequences_are_skipped() -> None:
    case = make_case([9, 30, 4], [0, 1, 0], block_size=8, num_heads=4, num_kv_heads=2, head_dim=32)
    for backend in ("reference", "cpu"):
        out = paged_attention(*case.args(), backend=backend)
        torch.testing.assert_close(out.double(), expected(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 2, 72), (9, 3, 64), (10, 2, 40), (14, 2, 16), (3, 3, 24)]
)
def test_cpu_decode_kernel_head_layouts(heads, kv_heads, head_dim, dtype) -> None:
    """GQA groups 2, 3, 5 and 7 (the kernel's loops take heads in pairs and a group's last
    three together), no GQA with an odd head count, head_dim not a multiple of 16: decode
    rows only, one long enough to be split across threads."""
    case = make_case([1, 7, 300, 2100], [1, 1, 1, 1], block_size=16, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)  # fmt: skip
    out = paged_attention(*case.args(), backend="cpu")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected(case), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_reads_strided_caches(dtype: torch.dtype) -> None:
    """Pools that are views into wider tensors (dense last dim, other strides not) give the
    same answer as contiguous ones: the decode kernel reads flat views, so they must not
    reach it (a reshape would silently read a copy)."""
    case = make_case([1, 20, 33], [1, 1, 4], block_size=8, num_heads=8, num_kv_heads=2,
                     head_dim=32, dtype=dtype)  # fmt: skip
    wide_k = torch.full((*case.key_cache.shape[:3], 48), float("nan"), dtype=dtype)
    wide_v = wide_k.clone()
    wide_k[..., :32], wide_v[..., :32] = case.key_cache, case.value_cache
    key_cache, value_cache = wide_k[..., :32], wide_v[..., :32]
    assert not key_cache.is_contiguous()
    args = (case.query, key_cache, value_cache, *case.args()[3:])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    out = paged_attention(*args, backend="cpu")
    torch.testing.assert_close(out.double(), expected(case), rtol=tol, atol=tol)
    key_cache.mul_(-0.5)  # in place, as writes of new KV do: the next call must see it
    value_cache.add_(1.0)
    out = paged_attention(*args, backend="cpu")
    torch.testing.assert_close(out, paged_attention(*args, backend="reference"), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_cpu_backend_other_dtypes(dtype: torch.dtype) -> None:
    """float16/float64 take the gather + SDPA path for every sequence."""
    case = make_case(
        [1, 20, 33],
        [1, 20, 3],
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
    )
    out = paged_attention(*case.args(), backend="cpu")
    assert out.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-10
    torch.testing.assert_close(out.double(), expected(case), rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 9])
def test_from_metadata_matches_plain_call(window: int | None) -> None:
    lens, queries = [1, 33, 200, 64], [1, 33, 1, 12]
    case = make_case(lens, queries, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    tables = [[b for b in row if b >= 0] for row in case.block_tables.tolist()]
    md = AttentionMetadata.build(tables, lens, queries, list(range(sum(queries))))
    assert md.max_query_len == 33 and md.max_seq_len == 200
    torch.testing.assert_close(md.block_tables, case.block_tables[:, : md.block_tables.shape[1]])
    plain = paged_attention(*case.args(), sliding_window=window)
    for _layer in range(2):  # the second call reuses the cached plan
        out = paged_attention_from_metadata(
            case.query, case.key_cache, case.value_cache, md, sliding_window=window
        )
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert len(md.plans) == 1
    md.backend = "reference"
    out = paged_attention_from_metadata(
        case.query, case.key_cache, case.value_cache, md, sliding_window=window
    )
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_plain_decode_batch_matches_planned_call(dtype: torch.dtype, window: int | None) -> None:
    """A plain call plans and runs in one; it agrees bit for bit with the planned call, here
    with rows split across threads and strided views as query and index tensors."""
    lens, queries = [1, 37, 700, 3000], [1, 1, 2, 4]
    case = make_case(lens, queries, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64,
                     dtype=dtype)  # fmt: skip
    tables = [[b for b in row if b >= 0] for row in case.block_tables.tolist()]
    md = AttentionMetadata.build(tables, lens, queries, list(range(sum(queries))))
    planned = paged_attention_from_metadata(
        case.query, case.key_cache, case.value_cache, md, sliding_window=window
    )
    wide = torch.full((case.block_tables.shape[0], 2 * case.block_tables.shape[1]), 7,
                      dtype=torch.int32)  # fmt: skip
    wide[:, ::2] = case.block_tables
    tokens, heads, dim = case.query.shape
    query = torch.empty(heads, tokens, dim, dtype=dtype).transpose(0, 1).copy_(case.query)
    assert not query.is_contiguous()
    lens_t = torch.stack([case.seq_lens, case.seq_lens], dim=1)[:, 0]
    assert not wide[:, ::2].is_contiguous() and not lens_t.is_contiguous()
    plain = paged_attention(query, case.key_cache, case.value_cache, wide[:, ::2], lens_t,
                            case.query_start_loc, sliding_window=window)  # fmt: skip
    assert plain.dtype == dtype
    torch.testing.assert_close(plain, planned, rtol=0, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(plain.double(), expected(case, window), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_plan_serves_every_layer(dtype: torch.dtype) -> None:
    """`plan` once per step, then each layer over its own cache pair runs that plan and
    matches a fresh plain call; a cache of another shape is refused, a bad query named."""
    lens, queries = [1, 37, 700, 3000], [1, 1, 1, 1]
    layers = [
        make_case(
            lens,
            queries,
            block_size=16,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            dtype=dtype,
            seed=seed,
        )  # fmt: skip
        for seed in (1, 2)
    ]
    tables = [[b for b in row if b >= 0] for row in layers[0].block_tables.tolist()]
    md = AttentionMetadata.build(tables, lens, queries, [0, 1, 2, 3])
    plan(md, layers[0].key_cache, layers[0].value_cache, num_heads=8)
    assert list(md.plans) == [None]
    for case in layers:
        out = paged_attention_from_metadata(layers[0].query, case.key_cache, case.value_cache, md)
        want = paged_attention(layers[0].query, case.key_cache, case.value_cache,
                               *layers[0].args()[3:])  # fmt: skip
        assert out.dtype == dtype
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert list(md.plans) == [None]
    with pytest.raises(ValueError, match=r"^query: expected head_dim 64"):
        paged_attention_from_metadata(
            layers[0].query[..., :32], layers[1].key_cache, layers[1].value_cache, md
        )
    smaller = layers[1].key_cache[:-1]
    with pytest.raises(ValueError, match=r"^key_cache: expected shape .* \(as planned\)"):
        paged_attention_from_metadata(layers[0].query, smaller, smaller.clone(), md)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_serial_and_parallel_kernels_agree(dtype: torch.dtype, block_size: int) -> None:
    """Small batches run on one thread, large ones on all: the same items, the same bits."""
    case = make_case([3, 13, 40, 901], [1, 1, 1, 1], block_size=block_size, num_heads=8,
                     num_kv_heads=2, head_dim=32, dtype=dtype)  # fmt: skip
    tables = [[b for b in row if b >= 0] for row in case.block_tables.tolist()]
    md = AttentionMetadata.build(tables, [3, 13, 40, 901], [1, 1, 1, 1], [0, 1, 2, 3])
    cpu_plan = cpu.plan(md, case.key_cache, 8, None)
    assert cpu_plan.items.shape[0] > 4  # the long row is split
    outs = []
    for parallel in (False, True):
        cpu_plan.parallel = parallel
        outs.append(cpu.run(case.query, case.key_cache, case.value_cache, cpu_plan, 32**-0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(outs[0].double(), expected(case), rtol=tol, atol=tol)


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE"])
def test_one_short_sequence_takes_every_thread_where_the_workers_spin(policy, monkeypatch):
    """Spinning workers start at once: a 600-token decode is split in balanced items and
    run on every thread; sleeping ones must be woken, so it stays on one, still cut in
    balanced items for the decoder stack's region, whose threads are awake. A batch that
    reads enough KV to go parallel with sleeping workers keeps items of MIN_CHUNK."""
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    monkeypatch.setattr(cpu, "sync_threads", lambda: 2)
    for kv_heads, head_dim in ((3, 64), (8, 128)):
        case = make_case([600], [1], block_size=16, num_heads=kv_heads * 3,
                         num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
        tables = [[b for b in row if b >= 0] for row in case.block_tables.tolist()]
        metadata = AttentionMetadata.build(tables, [600], [1], [0])
        cpu_plan = cpu.plan(metadata, case.key_cache, kv_heads * 3, None)
        lengths = (cpu_plan.items[:, 3] - cpu_plan.items[:, 2]).tolist()
        big = 600 * 2 * kv_heads * head_dim * 4 >= cpu.SERIAL_BYTES
        assert cpu_plan.parallel == (policy == "ACTIVE" or big)
        if policy == "PASSIVE" and big:
            assert lengths == [256, 256, 88]
        else:
            assert lengths == [160, 160, 160, 120]


def test_plain_decode_batch_rejects_bad_block_ids() -> None:
    case = make_case([5, 20], [1, 1], block_size=8, num_heads=4, num_kv_heads=2, head_dim=16)
    tables = case.block_tables.clone()
    tables[1, 2] = case.key_cache.shape[0]  # the last block of sequence 1
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match=r"^block_tables: expected block ids in \[0, "):
            paged_attention(case.query, case.key_cache, case.value_cache, tables, case.seq_lens,
                            case.query_start_loc, backend=backend)  # fmt: skip
