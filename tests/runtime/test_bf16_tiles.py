"""The tiled bfloat16 kernel (`products.tiled_rows`): the float32 sum rounded once, each
output's bits the same whatever rows stand beside it and however many threads share the
work, and `Linear` sends it the rows between the matrix-vector kernel's and oneDNN's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.ops.cpu.bf16 import HAS_DOT
from pagedkv.runtime.linear import Linear
from pagedkv.runtime.products import tiled_rows, tiles_apply
from pagedkv.runtime.tuning import CpuTuning

pytestmark = pytest.mark.skipif(not HAS_DOT, reason="no AVX512-BF16 dot product on this CPU")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 7, 17, 64])  # tiles of four rows and a part of one
@pytest.mark.parametrize("shape", [(65, 96), (3, 32), (130, 576)])
def test_tiled_rows_is_the_float32_sum_rounded_once(rows, shape):
    weight, x = _bf16(*shape, seed=rows), _bf16(rows, shape[1], seed=rows + 1)
    out = tiled_rows(weight)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
    exact = x.double() @ weight.double().T
    step = exact.abs().clamp_min(1e-30) * 2.0**-8
    assert ((out.double() - exact).abs() <= step * 1.01 + 1e-6).all()


@pytest.mark.parametrize("shape", [(130, 576), (7, 64)])
def test_each_output_s_bits_do_not_depend_on_other_rows_or_threads(shape):
    weight, x = _bf16(*shape, seed=3), _bf16(23, shape[1], seed=4)
    alone = tiled_rows(weight, parallel=False)
    full = alone(x)
    assert torch.equal(tiled_rows(weight, parallel=True)(x), full)
    for first, end in [(0, 1), (5, 6), (3, 11), (20, 23)]:
        assert torch.equal(alone(x[first:end]), full[first:end])


def test_tiled_rows_refuses_inputs_of_another_dtype():
    product = tiled_rows(torch.zeros(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected the weight's dtype torch.bfloat16"):
        product(torch.zeros(5, 32))


def test_what_the_tiled_kernel_multiplies():
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert tiles_apply(weight, None)
    assert not tiles_apply(weight, torch.zeros(8, dtype=torch.bfloat16))  # a bias
    assert not tiles_apply(torch.zeros(8, 48, dtype=torch.bfloat16), None)  # 48 % 32
    assert not tiles_apply(weight.float(), None)


def _layer(in_features: int, bias: bool) -> Linear:
    layer = Linear(in_features, 40, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(_bf16(40, in_features, seed=9))
        if bias:
            layer.bias.copy_(_bf16(40, seed=10))
    return layer


def _cancelling(rows: int) -> torch.Tensor:
    """Rows whose sum depends on the order of the additions: 2**24, 1 and -2**24 in three
    pairs of elements (exactly 1; 0 where the 1 is added to 2**24 first, as oneDNN adds
    along the row, and 1 where the tiled kernel's lanes are summed)."""
    x = torch.zeros(rows, 96)
    x[:, 0], x[:, 2], x[:, 4] = 2.0**24, 1.0, -(2.0**24)
    return x.to(torch.bfloat16)


def test_linear_sends_the_rows_between_the_few_and_onednn_to_the_tiled_kernel():
    layer = Linear(96, 40, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    layer.use_products(4, onednn=True, tuning=CpuTuning(tile_rows_bfloat16=16))
    assert (layer.few_rows, layer.tile_rows) == (4, 16)
    tiled = tiled_rows(layer.weight.detach())
    for rows in (5, 16, 17):
        x = _cancelling(rows)
        assert not torch.equal(tiled(x), F.linear(x, layer.weight))  # the routes differ here
        expected = tiled(x) if rows <= 16 else F.linear(x, layer.weight)  # oneDNN: torch's
        assert torch.equal(layer.forward(x), expected)


@pytest.mark.parametrize(
    ("in_features", "bias", "few_rows"), [(96, True, 4), (48, False, 4), (96, False, 0)]
)
def test_linear_keeps_the_tiled_kernel_off_where_it_does_not_apply(in_features, bias, few_rows):
    """A bias, a row length that is not a multiple of 32, or the kernels off (few_rows 0)."""
    layer = _layer(in_features, bias)
    layer.use_products(few_rows, onednn=True)
    assert layer.tile_rows == 0 and layer.tiled is None
