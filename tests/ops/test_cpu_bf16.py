"""The CPU backend's bfloat16 helpers, and bfloat16 decode rows over every GQA grouping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit
from paged_cases import expected, make_case

from pagedkv.ops import paged_attention
from pagedkv.ops.cpu import bf16
from pagedkv.runtime import kernel_cache


@njit
def _widen(bits):  # pragma: no cover
    out = np.empty(bits.shape[0], dtype=np.float32)
    for i in range(bits.shape[0]):
        out[i] = bf16.as_float32(bits[i])
    return out


@njit
def _round(values):  # pragma: no cover
    out = np.empty(values.shape[0], dtype=np.uint16)
    for i in range(values.shape[0]):
        out[i] = np.uint16(bf16.round_to_bf16(values[i]))
    return out


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _values() -> torch.Tensor:
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, 1.0e-38, 1.00390625, 1.01171875] * 5)
    return torch.cat([values, torch.randn(1000, generator=torch.Generator().manual_seed(1))])


def test_as_float32_widens_exactly() -> None:
    rounded = torch.cat([_values(), torch.tensor([float("inf")])]).to(torch.bfloat16)
    np.testing.assert_array_equal(_widen(_bits(rounded)), rounded.float().numpy())


def test_round_to_bf16_rounds_as_torch() -> None:
    """Nearest, ties to even (1 + 2^-8 and 1 + 3 * 2^-8 are ties), as `.to(torch.bfloat16)`."""
    values = _values()
    np.testing.assert_array_equal(_round(values.numpy()), _bits(values))


@njit
def _dot32(a, a_at, b, b_at, groups):  # pragma: no cover
    return bf16.dot32(a, a_at, b, b_at, groups)


@pytest.mark.skipif(not bf16.HAS_DOT, reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("groups", [0, 1, 3, 4, 9])  # none; fewer, as many and more than _SUMS
@pytest.mark.parametrize("offsets", [(0, 0), (7, 33)])  # unaligned rows
def test_dot32_sums_the_exact_products_in_float32(groups: int, offsets: tuple[int, int]) -> None:
    """Products of bfloat16 values are exact; only the float32 additions round."""
    generator = torch.Generator().manual_seed(groups)
    a, b = (torch.randn(400, generator=generator).to(torch.bfloat16) for _ in range(2))
    (a_at, b_at), count = offsets, 32 * groups
    got = _dot32(_bits(a), a_at, _bits(b), b_at, groups)
    products = a[a_at : a_at + count].double() * b[b_at : b_at + count].double()
    assert abs(got - products.sum().item()) <= 1e-6 * products.abs().sum().item()


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(32, 8, 128), (12, 4, 64), (6, 3, 64), (2, 2, 32), (7, 1, 96)]
)
def test_bfloat16_decode_matches_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    """Groups of 4, 3, 2, 1 and 7 (tiles of 4 heads and every remainder), decode rows only,
    one long enough to be split; within the suite's bfloat16 tolerance."""
    case = make_case([1, 31, 400, 2100], [1, 1, 2, 1], block_size=16, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16)  # fmt: skip
    out = paged_attention(*case.args(), backend="cpu")
    torch.testing.assert_close(out.double(), expected(case), rtol=2e-2, atol=2e-2)


def test_kernel_cache_key_covers_the_bf16_source(tmp_path, monkeypatch) -> None:
    """The kernels import bf16.py, whose changes Numba's cache cannot see: they change the
    shared copy's directory instead."""
    here = kernel_cache.kernel_dir()
    copy = tmp_path / "bf16.py"
    copy.write_text(bf16.__loader__.get_source(bf16.__name__) + "\n# changed\n")
    files = [copy if path.name == "bf16.py" else path for path in kernel_cache.KERNEL_FILES]
    monkeypatch.setattr(kernel_cache, "KERNEL_FILES", tuple(files))
    assert kernel_cache.kernel_dir() != here
