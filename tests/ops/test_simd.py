"""The 16-lane vector operations the CPU decode kernel is written with."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from pagedkv.ops import simd


@njit
def _sums(x, out):
    """out[0:16] = per-row sums of x [16 x 16] (flat), through the transposing tree."""
    ld = simd.vload
    tile = simd.vsum16(ld(x, 0), ld(x, 16), ld(x, 32), ld(x, 48), ld(x, 64), ld(x, 80),
                       ld(x, 96), ld(x, 112), ld(x, 128), ld(x, 144), ld(x, 160), ld(x, 176),
                       ld(x, 192), ld(x, 208), ld(x, 224), ld(x, 240))  # fmt: skip
    simd.vstore(out, 0, tile)


def test_vsum16_puts_the_sum_of_vector_j_in_lane_j() -> None:
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    out = np.zeros(16, dtype=np.float32)
    _sums(x, out)
    np.testing.assert_allclose(out, x.reshape(16, 16).sum(axis=1), rtol=1e-5, atol=1e-5)


@njit
def _arith(x, y, out):
    a, b = simd.vload(x, 0), simd.vload(y, 0)
    simd.vstore(out, 0, simd.vfma(a, b, simd.vsplat(np.float32(1.5))))  # a * b + 1.5
    simd.vstore(out, 16, simd.vadd(simd.vmul(a, simd.vsplat(simd.velem(y, 3))), b))  # a * y[3] + b
    out[32] = simd.velem(x, 5)


def test_lane_arithmetic() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 16)).astype(np.float32)
    out = np.zeros(33, dtype=np.float32)
    _arith(x, y, out)
    np.testing.assert_allclose(out[:16], x * y + 1.5, rtol=1e-6)
    np.testing.assert_allclose(out[16:32], x * y[3] + y, rtol=1e-6)
    assert out[32] == x[5]


@njit
def _partial(x, offset, n, out):
    simd.vstore(out, 0, simd.vload_n(x, offset, n))


def test_vload_n_reads_n_lanes_and_zeros_the_rest() -> None:
    """A row's last, partial vector: lanes past n are zero even when memory there holds NaN."""
    x = np.full(40, np.nan, dtype=np.float32)
    x[:21] = np.arange(21)
    out = np.empty(16, dtype=np.float32)
    _partial(x, 16, 5, out)
    np.testing.assert_array_equal(out, [16, 17, 18, 19, 20] + [0] * 11)
    _partial(x, 3, 16, out)
    np.testing.assert_array_equal(out, np.arange(3, 19))


def test_bfloat16_bits_are_widened() -> None:
    values = torch.linspace(-3, 3, 21).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    out = np.empty(16, dtype=np.float32)
    _partial(bits, 0, 16, out)
    np.testing.assert_array_equal(out, values[:16].float().numpy())
    _partial(bits, 16, 5, out)
    np.testing.assert_array_equal(out[:5], values[16:].float().numpy())


@njit
def _quarters(x, out):
    vec = simd.vload(x, 0)
    simd.vstore_quarter(out, 0, vec, 3)
    simd.vstore_quarter(out, 4, vec, 0)


def test_vstore_quarter_writes_four_lanes() -> None:
    x = np.arange(16, dtype=np.float32)
    out = np.full(10, -1.0, dtype=np.float32)
    _quarters(x, out)
    np.testing.assert_array_equal(out, [12, 13, 14, 15, 0, 1, 2, 3, -1, -1])


@njit
def _reductions(x, out):
    a, b = simd.vload(x, 0), simd.vload(x, 16)
    simd.vstore(out, 0, simd.vmax(a, b))
    simd.vstore(out, 16, simd.vsub(a, b))
    simd.vstore(out, 32, simd.vkeep(a, 5, np.float32(-7.0)))
    out[48] = simd.vhmax(a)
    out[49] = simd.vhsum(b)


def test_lane_max_difference_tail_fill_and_horizontal_reductions() -> None:
    x = np.random.default_rng(2).standard_normal(32).astype(np.float32)
    a, b = x[:16], x[16:]
    out = np.zeros(50, dtype=np.float32)
    _reductions(x, out)
    np.testing.assert_array_equal(out[:16], np.maximum(a, b))
    np.testing.assert_array_equal(out[16:32], a - b)
    np.testing.assert_array_equal(out[32:48], np.concatenate([a[:5], np.full(11, -7.0)]))
    assert out[48] == a.max()
    np.testing.assert_allclose(out[49], b.sum(), rtol=1e-5)


@njit
def _exps(x, out):
    for i in range(0, x.shape[0], 16):
        simd.vstore(out, i, simd.vexp_neg(simd.vload(x, i)))


def test_vexp_neg_matches_exp_to_float32_precision() -> None:
    """exp over [-100, 0]: relative error < 1e-6 for x >= -10 (where softmax weights
    matter), < 5e-6 down to the clamp at -87 (x * log2(e) rounded to float32), then the
    clamp."""
    x = np.linspace(-100.0, 0.0, 4096, dtype=np.float32)
    out = np.empty_like(x)
    _exps(x, out)
    want = np.exp(np.maximum(x, -87.0).astype(np.float64))
    near = x >= -10
    np.testing.assert_allclose(out[near], want[near], rtol=1e-6)
    np.testing.assert_allclose(out, want, rtol=5e-6)
    assert out[-1] == 1.0
