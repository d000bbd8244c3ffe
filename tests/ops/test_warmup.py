"""`pagedkv.ops.warmup` readies the backend's kernels without touching the cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedkv import kernel_cache
from pagedkv.ops import warmup

_PROBE = """
import torch
from pagedkv.ops import cpu, cpu_dense, warmup

for dtype in (torch.float32, torch.bfloat16):
    key_cache = torch.randn(3, 4, 2, 8).to(dtype)
    value_cache = torch.randn(3, 4, 2, 8).to(dtype)
    before = key_cache.clone(), value_cache.clone()
    warmup(key_cache, value_cache, 4)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
k = cpu._kernels
m = cpu_dense._matvec
for kernel in (k.plan_items, k.decode_serial, k.decode_parallel, m.matvec, m.matvec_parallel):
    print(kernel.__name__, "|".join(str(sig) for sig in kernel.signatures))
"""


def _probe(cache_dir: str) -> tuple[dict[str, str], str]:
    env = os.environ | {"PAGEDKV_CACHE_DIR": cache_dir}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines()), result.stderr


def test_warmup_compiles_every_kernel_once_per_machine(tmp_path) -> None:
    """In a fresh process (compiled signatures are per process), warm-up alone readies the
    planner, both decode kernels for float32 and bfloat16 caches and both matrix-vector
    kernels for float32 and bfloat16 weights, saying so in one line; a second process with
    the same cache loads them and says nothing."""
    signatures, stderr = _probe(str(tmp_path))
    assert stderr.count("pagedkv: compiling CPU kernels once") == 1, stderr
    assert str(tmp_path) in stderr
    assert signatures["plan_items"]
    for name in ("decode_serial", "decode_parallel"):
        assert "Array(float32, 3, 'C'" in signatures[name], signatures[name]
        assert "Array(uint16, 3, 'C'" in signatures[name], signatures[name]
    for name in ("matvec", "matvec_parallel"):
        for weight in ("float32", "uint16"):
            assert f"Array({weight}, 2, 'C'" in signatures[name], signatures[name]
    again, stderr = _probe(str(tmp_path))
    assert "compiling" not in stderr, stderr
    assert again == signatures


def test_kernel_cache_is_keyed_by_source_not_path(tmp_path, monkeypatch) -> None:
    """Two checkouts or venvs with the same kernels share one compiled copy."""
    here = kernel_cache.kernel_dir()
    copy = tmp_path / "elsewhere" / "kernels.py"
    copy.parent.mkdir()
    copy.write_bytes(kernel_cache._SOURCES[0].read_bytes())
    monkeypatch.setattr(kernel_cache, "_SOURCES", (copy, *kernel_cache._SOURCES[1:]))
    assert kernel_cache.kernel_dir() == here
    copy.write_text(copy.read_text() + "\n# changed\n")
    assert kernel_cache.kernel_dir() != here


def test_warmup_with_a_backend_without_one_is_a_no_op() -> None:
    key_cache = torch.zeros(2, 4, 1, 8)
    warmup(key_cache, key_cache.clone(), 2, backend="reference")


@pytest.mark.parametrize("num_heads", [0, 3, 2.0, True])
def test_warmup_rejects_bad_num_heads(num_heads) -> None:
    key_cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^num_heads: expected a positive multiple"):
        warmup(key_cache, key_cache.clone(), num_heads)


def test_warmup_rejects_mismatched_caches() -> None:
    with pytest.raises(ValueError, match=r"^value_cache: expected"):
        warmup(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 4), 2)
