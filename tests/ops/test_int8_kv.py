"""int8 KV caches: quantization as written, and the CPU backend against the reference on the
same int8 data over every shape of the float grid."""

from __future__ import annotations

import pytest
import torch
from paged_cases import ATTENTION_GRID, check_backend, expected, make_case, quantized

from pagedkv.ops import AttentionMetadata, cpu, paged_attention, write_kv
from pagedkv.ops.quantize import dequantize, quantize


@pytest.mark.parametrize("p", ATTENTION_GRID)
def test_cpu_backend_matches_reference_on_int8_caches(p: dict) -> None:
    check_backend("cpu", p, int8=True)


def test_quantize_is_symmetric_per_row_and_zero_safe() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    rows[7, 1] = 0.0
    data, scales = quantize(rows)
    assert data.dtype == torch.int8 and scales.dtype == torch.float16
    assert scales.shape == (50, 3)
    assert data.abs().max() <= 127 and data[7, 1].abs().sum() == 0 and scales[7, 1] == 0
    # the largest element of each row lands at +-127 (the scale is max|x| / 127)
    assert (data.abs().amax(-1)[scales > 0] >= 126).all()
    back = dequantize(data, scales, torch.float32)
    step = scales.float().unsqueeze(-1)
    assert ((back - rows).abs() <= 0.5 * step * 1.01 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_write_kv_quantizes_each_row_as_the_reference_does(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    pools = [torch.zeros(6, 4, 2, 16, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(6, 4, 2, dtype=torch.float16) for _ in range(2)]
    # rows from 1e-6 to 1e4 in size (ties and float16's subnormal scales), one all zero
    sizes = torch.logspace(-6, 4, 9, dtype=torch.float64)[:, None, None]
    key, value = ((torch.randn(9, 2, 16, generator=gen) * sizes).to(dtype) for _ in range(2))
    key[4, 1] = 0.0
    slots = torch.tensor([0, 5, -1, 23, 7, 8, 9, -1, 12])
    write_kv(key, value, *pools, slots, key_scales=scales[0], value_scales=scales[1])
    keep = slots >= 0
    for rows, pool, pool_scales in zip((key, value), pools, scales, strict=True):
        data, row_scales = quantize(rows[keep])
        assert torch.equal(pool.view(-1, 2, 16)[slots[keep]], data)
        assert torch.equal(pool_scales.view(-1, 2)[slots[keep]], row_scales)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert pools[0].view(-1, 2, 16)[untouched].abs().sum() == 0


def test_int8_write_kv_takes_strided_rows_and_int32_slots_and_rejects_a_slot_past_the_end():
    gen = torch.Generator().manual_seed(3)
    pools = [torch.zeros(4, 4, 2, 8, dtype=torch.int8) for _ in range(2)]
    scales = {name: torch.zeros(4, 4, 2, dtype=torch.float16) for name in ("key", "value")}
    key = torch.randn(6, 2, 8, generator=gen).bfloat16()[::2]  # every other token
    value = torch.randn(3, 2, 8, generator=gen).bfloat16()
    slots = torch.tensor([5, -1, 15], dtype=torch.int32)
    write_kv(key, value, *pools, slots, key_scales=scales["key"], value_scales=scales["value"])
    data, row_scales = quantize(key)
    assert torch.equal(pools[0][1, 1], data[0]) and torch.equal(pools[0][3, 3], data[2])
    assert torch.equal(scales["key"][3, 3], row_scales[2])
    assert torch.equal(pools[1][3, 3], quantize(value)[0][2])
    before = [t.clone() for t in (*pools, *scales.values())]
    past = r"^slot_mapping: expected slots < .* = 16, got .*\[2\] = 16"
    with pytest.raises(ValueError, match=past):
        write_kv(value, key, *pools, torch.tensor([0, 1, 16]), key_scales=scales["key"],
                 value_scales=scales["value"])  # fmt: skip
    after = (*pools, *scales.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a row written"


def test_int8_attention_stays_close_to_the_float_cache() -> None:
    """Quantizing changes the output by about the int8 step, not more."""
    case = make_case([300, 40], [1, 40], block_size=16, num_heads=6, num_kv_heads=2, head_dim=64)
    full = paged_attention(*case.args(), backend="cpu")
    q8 = quantized(case)
    out = paged_attention(*q8.args(), backend="cpu", **q8.scales)
    assert (out - full).abs().max() < 0.05
    assert (out - full).abs().max() > 0  # it does read the int8 data


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(4, 2, 72), (9, 3, 64), (10, 2, 40), (14, 2, 16), (3, 3, 24), (16, 2, 128)],
)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_decode_kernel_head_layouts(heads, kv_heads, head_dim, query_dtype) -> None:
    case = make_case([1, 7, 300, 2100], [1, 1, 1, 1], block_size=16, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, dtype=query_dtype)  # fmt: skip
    q8 = quantized(case)
    out = paged_attention(*q8.args(), backend="cpu", **q8.scales)
    tol = 2e-2 if query_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected(q8), rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_serial_and_parallel_int8_kernels_agree(block_size: int) -> None:
    case = make_case([900, 33, 2], [1, 1, 1], block_size=block_size, num_heads=8,
                     num_kv_heads=2, head_dim=64)  # fmt: skip
    q8 = quantized(case)
    md = AttentionMetadata(torch.zeros(3, dtype=torch.int64), *case.args()[3:])
    scales = (q8.scales["key_scales"], q8.scales["value_scales"])
    made = cpu.plan(md, q8.case.key_cache, 8, None)
    outs = []
    for parallel in (False, True):
        made.parallel = parallel
        outs.append(
            cpu.run(case.query, q8.case.key_cache, q8.case.value_cache, made, 0.125, scales)
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_int8_caches_require_their_scales() -> None:
    case = make_case([5], [1], block_size=4, num_heads=2, num_kv_heads=1, head_dim=8)
    q8 = quantized(case)
    with pytest.raises(ValueError, match="key_scales: expected float16 scales"):
        paged_attention(*q8.args(), backend="cpu")
    with pytest.raises(ValueError, match="value_scales: expected a tensor"):
        paged_attention(*q8.args(), backend="cpu", key_scales=q8.scales["key_scales"])
    with pytest.raises(ValueError, match="key_scales: expected None for a torch.float32"):
        paged_attention(*case.args(), backend="cpu", **q8.scales)
    bad = {k: t.float() for k, t in q8.scales.items()}
    with pytest.raises(ValueError, match="key_scales: expected float16 of shape"):
        paged_attention(*q8.args(), backend="cpu", **bad)
    rows = torch.zeros(1, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="key: expected float32, bfloat16"):
        write_kv(rows, rows, q8.case.key_cache, q8.case.value_cache,
                 torch.zeros(1, dtype=torch.int64), **q8.scales)  # fmt: skip


@pytest.mark.parametrize("head_dim", [8, 24, 64, 72, 136])
def test_accumulate_rows_adds_each_heads_scaled_v_rows_and_nothing_else(head_dim) -> None:
    """The int8 accumulate step's vector code: rows in passes of 64 elements with a masked
    last vector, heads in blocks of four and the rest, every head from the same V rows
    times their scales, no element outside the heads' rows."""
    import numpy as np
    from numba import njit

    from pagedkv.ops.cpu.tiles import accumulate_rows

    @njit
    def rows(v, scales, slots, n, known, g, w, acc, h0, num_heads):  # pragma: no cover
        accumulate_rows(v, v, scales, slots, n, known, g, w, acc, h0, num_heads)

    rng = np.random.default_rng(head_dim)
    v = rng.integers(-127, 128, (10, 2, head_dim)).astype(np.int8)
    scales = rng.uniform(0.01, 2, (10, 2)).astype(np.float16)
    w = rng.standard_normal((7, 8)).astype(np.float32)
    acc = rng.standard_normal((7, head_dim)).astype(np.float32)
    slots, g = np.array([7, 2, 9, 4, 0, 5, 3, 1], dtype=np.int64), 1
    expected = acc.astype(np.float64)
    weighted = w[1:6, :6].astype(np.float64) * scales[slots[:6], g].astype(np.float64)
    expected[1:6] += weighted @ v[slots[:6], g].astype(np.float64)
    rows(v, scales.view(np.uint16), slots, 6, 8, g, w, acc, 1, 5)  # heads 1..5, tokens 0..5
    np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(acc[[0, 6]], expected[[0, 6]].astype(np.float32))


def test_accumulate_rows_drops_weights_that_a_scale_makes_subnormal() -> None:
    """A weight times its V scale below float32's smallest normal adds nothing (subnormal
    operands take the CPU's slow path); one just above it is kept."""
    import numpy as np
    from numba import njit

    from pagedkv.ops.cpu.tiles import accumulate_rows

    @njit
    def rows(v, scales, slots, n, w, acc):  # pragma: no cover
        accumulate_rows(v, v, scales, slots, n, n, 0, w, acc, 0, 2)

    v = np.full((4, 1, 16), 100, dtype=np.int8)
    scales = np.full((4, 1), 0.5, dtype=np.float16)
    w = np.array([[1.5e-38] * 4, [3e-38] * 4], dtype=np.float32)  # x 0.5: below, above 2^-126
    acc = np.zeros((2, 16), dtype=np.float32)
    rows(v, scales.view(np.uint16), np.arange(4, dtype=np.int64), 4, w, acc)
    assert not acc[0].any()
    np.testing.assert_allclose(acc[1], 4 * 1.5e-38 * 100, rtol=1e-5)
