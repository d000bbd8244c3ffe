"""GGML block formats held in place: dequantization against llama.cpp's own Python
tooling (`gguf.quants`), and the products against the dequantized weight's product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.gguf_models import random_blocks

from pagedkv.runtime.quant import dots
from pagedkv.runtime.quant import weight as weight_module
from pagedkv.runtime.quant.formats import FORMATS
from pagedkv.runtime.quant.quantize import quantize
from pagedkv.runtime.quant.weight import QuantPart, QuantWeight

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_matches_gguf(name: str) -> None:
    fmt = FORMATS[name]
    blocks = random_blocks(fmt, 7, 512)
    weight = QuantWeight([QuantPart(fmt, blocks)], 512)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]))
    torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=0)
    # bfloat16 rows: the same numbers rounded as torch rounds them (a "none" model's weights)
    rows = torch.empty(7, 512, dtype=torch.bfloat16)
    weight.parts[0].dequantize_into(np.arange(7)[::-1].copy(), rows)
    assert torch.equal(rows.view(torch.int16), expected.flip(0).bfloat16().view(torch.int16))


def _mixed_weight(name: str, in_features: int = 512) -> QuantWeight:
    """37 rows in format `name`, then 5 in another: a fused projection of a mixed file."""
    fmt, other = FORMATS[name], FORMATS["Q6_K" if name != "Q6_K" else "Q8_0"]
    parts = [QuantPart(fmt, random_blocks(fmt, 37, in_features)),
             QuantPart(other, random_blocks(other, 5, in_features, seed=1))]  # fmt: skip
    return QuantWeight(parts, in_features)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("parallel", [False, True])
def test_products_match_dequantized(
    name: str, rows: int, parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiles of 8 rows: some cross the parts' boundary, the last is short.
    monkeypatch.setattr(weight_module, "TILE_BYTES", 8 * 4 * 512)
    weight, in_features = _mixed_weight(name), 512
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(42)
    dense = weight.dequantize().double()
    expected = x.double() @ dense.T + bias.double()
    rounding = 1e-5 * (x.double().abs() @ dense.abs().T).max().item()
    got = weight.matmul(x, bias)
    assert got.shape == (rows, 42) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max().item() <= rounding
    # The few-row product quantizes x to integers in groups of each part's block size: an
    # element is off by at most half its group's step (largest magnitude / its levels).
    groups = [part.format.block_size for part in weight.parts]
    steps = torch.cat([_activation_steps(x, groups[0]) @ dense[:37].abs().T,
                       _activation_steps(x, groups[1]) @ dense[37:].abs().T], dim=1)  # fmt: skip
    got = weight.few_rows(x, bias, 0 if parallel else float("inf"))
    assert got.shape == (rows, 42) and got.dtype == torch.float32
    error = (got.double() - expected).abs()
    assert (error <= steps / 2 + rounding).all()


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("tile_rows", [8, 64])
def test_bfloat16_tiles_multiply_the_weights_rounded_to_bfloat16(
    name: str, tile_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 input's many-row product: the weights rounded to bfloat16 (as a "none"
    model's), products summed in float32, the result (bias added) rounded once."""
    if weight_module.tile_dtype(torch.bfloat16) != torch.bfloat16:
        pytest.skip("oneDNN does not multiply bfloat16 on this CPU")
    monkeypatch.setattr(weight_module, "TILE_BYTES", tile_rows * 2 * 512)
    weight = _mixed_weight(name)
    x = torch.randn(24, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    bias = torch.randn(42).bfloat16()
    rounded = weight.dequantize().bfloat16().double()
    expected = x.double() @ rounded.T + bias.double()
    got = weight.matmul(x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (24, 42)
    # rounded once to bfloat16 (half a step: 2^-9 of the magnitude), float32 sums
    bound = expected.abs() * 2.0**-8 + 1e-5 * (x.double().abs() @ rounded.abs().T)
    assert ((got.double() - expected).abs() <= bound).all()


def _activation_steps(x: torch.Tensor, group: int) -> torch.Tensor:
    """x: [rows, in_features] -> each element's quantization step, float64 [rows, in]."""
    largest = x.double().abs().reshape(x.shape[0], -1, group).amax(dim=-1, keepdim=True)
    return (largest / dots.LEVELS[group]).expand(-1, -1, group).reshape(x.shape)


def test_bfloat16_rows_give_the_float32_result_rounded() -> None:
    fmt = FORMATS["Q4_K"]
    weight = QuantWeight([QuantPart(fmt, random_blocks(fmt, 16, 256))], 256)
    x = torch.randn(2, 256).bfloat16()
    got = weight.few_rows(x, None, float("inf"))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, weight.few_rows(x.float(), None, float("inf")).bfloat16())


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_quantize_matches_gguf_and_round_trips(name: str) -> None:
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    part = quantize(w, name)
    qtype = gguf.GGMLQuantizationType[name.upper()]
    reference = gguf.quants.quantize(w.numpy(), qtype)
    # Ties may round either way in Q8_0; the bytes agree elsewhere.
    assert (part.blocks != reference).mean() < 1e-3
    step = w.abs().amax() / (127 if name == "q8_0" else 7)
    error = (QuantWeight([part], 256).dequantize() - w).abs().max()
    assert error <= step


def test_bad_shapes_are_rejected() -> None:
    fmt = FORMATS["Q4_K"]
    with pytest.raises(ValueError, match="in_features: expected a multiple of 256"):
        QuantWeight([QuantPart(fmt, random_blocks(fmt, 2, 256))], 300)
    with pytest.raises(ValueError, match="blocks: expected"):
        QuantWeight([QuantPart(fmt, random_blocks(fmt, 2, 512))], 256)
    with pytest.raises(ValueError, match="quantization: expected one of"):
        quantize(torch.zeros(2, 32), "q4_k")
    weight = QuantWeight([QuantPart(fmt, random_blocks(fmt, 2, 256))], 256)
    with pytest.raises(ValueError, match=r"x: expected \[num_tokens, 256\]"):
        weight.matmul(torch.zeros(3, 128))


def test_half_scales_read_exactly() -> None:
    """Every fp16 bit pattern (subnormals, infinities and NaNs among them) as float32."""
    from numba import njit

    from pagedkv.runtime.quant.vectors import half

    @njit
    def read_all(raw: np.ndarray, out: np.ndarray) -> None:
        for i in range(out.shape[0]):
            out[i] = half(raw, 2 * i)

    patterns = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(len(patterns), dtype=np.float32)
    read_all(patterns.view(np.uint8), got)
    expected = patterns.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(expected)],
                                  expected.view(np.uint32)[~np.isnan(expected)])  # fmt: skip
    assert np.isnan(got[np.isnan(expected)]).all()
