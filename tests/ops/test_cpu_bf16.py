"""The CPU backend's bfloat16 helpers, its dot-instruction path against the generic one, and
the kernels compiled for a CPU without AVX-512 (the fallback of `bf16.dot_bf16`)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from numba import njit
from paged_cases import expected, make_case

from pagedkv import kernel_cache
from pagedkv.ops import cpu, paged_attention
from pagedkv.ops.cpu import bf16


@njit
def _dots(q, q_offset, k, k_offsets, length, count):  # pragma: no cover
    return np.array(bf16.dot_bf16(q, q_offset, k, k_offsets, length, count))


@njit
def _widen(bits):  # pragma: no cover
    out = np.empty(bits.shape[0], dtype=np.float32)
    for i in range(bits.shape[0]):
        out[i] = bf16.as_float32(bits[i])
    return out


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def check_dot_bf16() -> None:
    """dot_bf16 against float64 sums of the same bfloat16 values, every count and a few
    lengths, rows at offsets inside larger arrays, key rows in either order."""
    gen = torch.Generator().manual_seed(0)
    for length in (32, 64, 128, 256):
        for count in (1, 2, 3, 4):
            q = torch.randn(6 * length, generator=gen).to(torch.bfloat16)
            k = torch.randn(3, length, generator=gen).to(torch.bfloat16)
            got = _dots(_bits(q), length, _bits(k), (2 * length, length), length, count)
            assert got.dtype == np.float32 and got.shape == (8,)
            got = got.reshape(2, 4)[:, :count]  # (key row, query row); the rest unused
            rows = q.double()[length : (count + 1) * length].view(count, length)
            products = rows[None] * k.double()[[2, 1], None]  # (key row, query row, length)
            want = products.sum(-1).numpy()
            bound = 1e-6 * products.abs().sum(-1).numpy() * np.sqrt(length)
            np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)


def test_dot_bf16_matches_float64() -> None:
    check_dot_bf16()


def test_as_float32_widens_exactly() -> None:
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, 1.0e-38, float("inf")] * 5)
    values = torch.cat([values, torch.randn(1000, generator=torch.Generator().manual_seed(1))])
    rounded = values.to(torch.bfloat16)
    np.testing.assert_array_equal(_widen(_bits(rounded)), rounded.float().numpy())


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(32, 8, 128), (12, 4, 64), (6, 3, 64), (2, 2, 32), (7, 1, 96)]
)
def test_dot_path_matches_generic_path_and_reference(
    heads: int, kv_heads: int, head_dim: int, monkeypatch
) -> None:
    """Groups of 4, 3, 2, 1 and 7 (tiles of 4 heads and every remainder), decode rows only,
    one long enough to be split; both paths within the suite's bfloat16 tolerance."""
    case = make_case([1, 31, 400, 2100], [1, 1, 2, 1], block_size=16, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16)  # fmt: skip
    assert cpu.uses_dot(case.key_cache) == bf16.HAS_DOT_INSTRUCTION
    native = paged_attention(*case.args(), backend="cpu")
    monkeypatch.setenv(cpu.ISA_ENV, "generic")
    assert not cpu.uses_dot(case.key_cache)
    generic = paged_attention(*case.args(), backend="cpu")
    want = expected(case)
    for out in (native, generic):
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_dot_path_is_only_for_bfloat16_rows_of_whole_steps(monkeypatch) -> None:
    monkeypatch.setenv(cpu.ISA_ENV, "native")
    has = bf16.HAS_DOT_INSTRUCTION
    assert cpu.uses_dot(torch.zeros(2, 4, 2, 64, dtype=torch.bfloat16)) == has
    assert not cpu.uses_dot(torch.zeros(2, 4, 2, 40, dtype=torch.bfloat16))
    assert not cpu.uses_dot(torch.zeros(2, 4, 2, 64, dtype=torch.float32))
    monkeypatch.setenv(cpu.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match=r'^PAGEDKV_CPU_ISA: expected "native" or "generic"'):
        cpu.uses_dot(torch.zeros(2, 4, 2, 64, dtype=torch.bfloat16))


_WITHOUT_AVX512 = """
import sys
sys.path.insert(0, sys.argv[1])
import test_cpu_bf16 as t
from pagedkv.ops.cpu import bf16
assert not bf16.HAS_DOT_INSTRUCTION
t.check_dot_bf16()
t.test_as_float32_widens_exactly()
for layout in [(32, 8, 128), (12, 4, 64), (6, 3, 64)]:
    t.test_dot_path_matches_generic_path_and_reference(*layout, t.pytest.MonkeyPatch())
print("ok")
"""


@pytest.mark.slow
def test_kernels_compiled_for_a_cpu_without_avx512(tmp_path) -> None:
    """Compiled for an AVX2-only CPU (NUMBA_CPU_NAME=haswell), the fallback of `dot_bf16`
    (two FMAs per pair) runs, and both bfloat16 paths still match the reference."""
    env = os.environ | {"PAGEDKV_CACHE_DIR": str(tmp_path), "NUMBA_CPU_NAME": "haswell"}
    env.pop("NUMBA_CPU_FEATURES", None)
    env[cpu.ISA_ENV] = "native"
    here = os.path.dirname(__file__)
    result = subprocess.run([sys.executable, "-c", _WITHOUT_AVX512, here], capture_output=True,
                            text=True, timeout=900, env=env)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_kernel_cache_key_covers_the_bf16_source(tmp_path, monkeypatch) -> None:
    """The kernels import bf16.py, whose changes Numba's cache cannot see: they change the
    shared copy's directory instead."""
    here = kernel_cache.kernel_dir()
    copy = tmp_path / "bf16.py"
    copy.write_text(bf16.__loader__.get_source(bf16.__name__) + "\n# changed\n")
    monkeypatch.setattr(kernel_cache, "_IMPORTED", (copy,))
    assert kernel_cache.kernel_dir() != here
