"""`pagedkv.ops.warmup` readies the backend's kernels without touching the cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedkv.ops import cpu_launch, warmup

_PROBE = """
import torch
from pagedkv.ops import cpu_kernels, cpu_plan, warmup

for dtype in (torch.float32, torch.bfloat16):
    key_cache = torch.randn(3, 4, 2, 8).to(dtype)
    value_cache = torch.randn(3, 4, 2, 8).to(dtype)
    before = key_cache.clone(), value_cache.clone()
    warmup(key_cache, value_cache, 4)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
for kernel in (cpu_plan.plan_items, cpu_kernels.decode, cpu_kernels.plan_and_decode,
               cpu_kernels.write_rows):
    print(kernel.__name__, "|".join(str(sig) for sig in kernel.signatures))
"""


def test_warmup_compiles_every_kernel_and_leaves_the_cache_alone() -> None:
    """In a fresh process (compiled signatures are per process), warm-up alone readies the
    planner, the decode kernel for planned batches and for plain calls, and the write, for
    float32 and bfloat16 caches (without the C++ launcher: the kernels its Python paths
    call)."""
    env = os.environ | {cpu_launch.DISABLE_ENV: "0"}  # the Python paths' kernels
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    signatures = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert signatures["plan_items"]
    for name in ("decode", "plan_and_decode"):
        assert "Array(float32, 1, 'C'" in signatures[name], signatures[name]
        assert "Array(uint16, 1, 'C'" in signatures[name], signatures[name]
    assert "Array(uint64, 2, 'C'" in signatures["write_rows"], signatures["write_rows"]


_LAUNCHER_PROBE = """
import torch
from pagedkv.ops import cpu, cpu_launch, warmup

key_cache, value_cache = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
cpu._flat_views(key_cache, value_cache)  # a memo made before the launcher is loaded
warmup(key_cache, value_cache, 4)
assert cpu_launch.loaded() is not None
assert key_cache.__dict__[cpu._FLAT_MEMO][3].launch is not None
print("ok")
"""


def test_warmup_loads_the_launcher_and_remakes_older_views() -> None:
    """Warm-up builds or loads the C++ launcher (an engine's start-up), and the pair's
    views made before it get the launcher's blocks."""
    if os.environ.get(cpu_launch.DISABLE_ENV) == "0":
        pytest.skip(f"{cpu_launch.DISABLE_ENV}=0")
    result = subprocess.run(
        [sys.executable, "-c", _LAUNCHER_PROBE], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


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
