"""The Triton kernels compile for sm_90 (H100/H200) without a GPU: no spills, loads pipelined.

The interpreter (test_triton.py) checks results but not code generation: a kernel can
pass there and still fail to compile, spill registers or lose its software pipeline.
Compilation needs kernels defined without ``TRITON_INTERPRET``, which test_triton.py
sets in this process, so the check runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_MAX_SHARED = 227 * 1024  # per-block limit on sm_90
# (dtype, block_size, group, head_dim, window, int8 KV): the target config, the odd corners,
# and SmolLM2's geometry over an int8 cache.
_CONFIGS = [
    ("bf16", 16, 4, 128, False, False),
    ("fp16", 5, 3, 80, True, False),
    ("bf16", 128, 8, 128, False, False),
    ("fp32", 32, 8, 40, False, False),
    ("bf16", 16, 3, 64, False, True),
]
_SCRIPT = """
import json, sys
from dataclasses import asdict
sys.path.insert(0, "benchmarks")
from triton_compile_check import compile_kernels
for dtype, bs, group, dim, window, int8_kv in json.loads(sys.argv[1]):
    for r in compile_kernels(dtype=dtype, block_size=bs, group=group, head_dim=dim,
                             use_window=window, int8_kv=int8_kv):
        print(json.dumps(asdict(r)))
"""


@pytest.mark.skipif(not _PTXAS.exists(), reason="triton's bundled ptxas is missing")
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(_CONFIGS)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) >= 4 * len(_CONFIGS)
    for report in reports:
        name = report["name"]
        assert report["spill_bytes"] in (0, None), f"{name} spills registers: {report}"
        assert report["shared_bytes"] <= _MAX_SHARED, f"{name} needs too much shared memory"
        if name.startswith(("_decode_kernel", "_prefill_kernel")):
            # K/V tiles arrive by cp.async ahead of use: the loop is software-pipelined.
            assert report["async_copies"] > 0, f"{name} loads are not pipelined: {report}"
            if "fp32" not in name:
                assert report["tensor_core_ops"] > 0, f"{name} does not use tensor cores"
