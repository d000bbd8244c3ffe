"""`pagedkv.ops.warmup` readies the backend's kernels without touching the cache, and
`pagedkv.runtime.decode.warmup` the runtime's; both compile once per machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.ops import warmup
from pagedkv.runtime import kernel_cache

_PROBE = """
import sys
import torch
from pagedkv.ops import warmup
from pagedkv.ops.cpu import kernels as k
from pagedkv.runtime import decode, matvec as m

for name in sys.argv[1:]:
    dtype = getattr(torch, name)
    key_cache = torch.randn(3, 4, 2, 8).to(dtype)
    value_cache = torch.randn(3, 4, 2, 8).to(dtype)
    before = key_cache.clone(), value_cache.clone()
    warmup(key_cache, value_cache, 4)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
    if dtype in (torch.float32, torch.bfloat16):
        decode.warmup(dtype)
# per compiled variant its second argument's type: the key cache's, or the weight's
for kernel in (k.plan_items, k.decode_serial, k.decode_parallel, m.matvec, m.matvec_parallel):
    print(kernel.__name__, "|".join(str(sig[1]) for sig in kernel.signatures))
"""
_ARRAYS = {"float32": "array(float32, {}d, C)", "bfloat16": "array(uint16, {}d, C)"}


def _probe(cache_dir: str, *dtypes: str, src: str | None = None) -> tuple[dict[str, str], str]:
    env = os.environ | {"PAGEDKV_CACHE_DIR": cache_dir}
    if src is not None:  # another checkout of the same sources
        env["PYTHONPATH"] = src
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *dtypes],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines()), result.stderr


def _compiled_for(signatures: dict[str, str], dtype: str) -> bool:
    """Whether both decode kernels and both matrix-vector kernels have `dtype`'s variant."""
    decode = all(
        _ARRAYS[dtype].format(3) in signatures[n] for n in ("decode_serial", "decode_parallel")
    )
    matvec = all(_ARRAYS[dtype].format(2) in signatures[n] for n in ("matvec", "matvec_parallel"))
    assert decode == matvec, signatures
    return decode


def test_warmup_compiles_a_dtypes_kernels_once_per_machine(tmp_path) -> None:
    """In a fresh process (compiled signatures are per process), warm-up alone readies the
    planner, both decode kernels and both matrix-vector kernels for its cache's dtype, and
    only for it, saying so in one line; the other dtype's first warm-up says so again; a
    later process with both in the cache loads them and says nothing."""
    signatures, stderr = _probe(str(tmp_path), "float32")
    assert stderr.count("pagedkv: compiling CPU kernels once") == 1, stderr
    assert str(tmp_path) in stderr
    assert signatures["plan_items"]
    assert _compiled_for(signatures, "float32") and not _compiled_for(signatures, "bfloat16")
    signatures, stderr = _probe(str(tmp_path), "bfloat16")
    assert stderr.count("pagedkv: compiling CPU kernels once") == 1, stderr
    assert _compiled_for(signatures, "bfloat16") and not _compiled_for(signatures, "float32")
    both, stderr = _probe(str(tmp_path), "float32", "bfloat16", "float16")
    assert "compiling" not in stderr, stderr
    assert _compiled_for(both, "float32") and _compiled_for(both, "bfloat16")
    # Another checkout (a copy of the package elsewhere) loads the same compiled code: the
    # shared directory gains no file and the copy's own tree gets no Numba cache.
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(kernel_cache.__file__).parents[2], checkout,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    before = sorted(tmp_path.glob("cpu-kernels/*/*"))
    again, stderr = _probe(str(tmp_path), "float32", "bfloat16", src=str(checkout))
    assert "compiling" not in stderr, stderr
    assert _compiled_for(again, "float32") and _compiled_for(again, "bfloat16")
    assert sorted(tmp_path.glob("cpu-kernels/*/*")) == before
    assert not list(checkout.rglob("*.nbi"))


def test_kernel_cache_is_keyed_by_source_not_path(tmp_path, monkeypatch) -> None:
    """Two checkouts or venvs with the same kernels share one compiled copy."""
    here = kernel_cache.kernel_dir()
    copy = tmp_path / "elsewhere" / "kernels.py"
    copy.parent.mkdir()
    copy.write_bytes(kernel_cache.KERNEL_FILES[0].read_bytes())
    monkeypatch.setattr(kernel_cache, "KERNEL_FILES", (copy, *kernel_cache.KERNEL_FILES[1:]))
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


_INT8_PROBE = """
import torch
from pagedkv.runtime import decode, stack

decode.warmup(torch.bfloat16, torch.int8)
print("|".join(str(sig) for sig in stack.decode_layers.signatures))
"""


def test_runtime_warmup_compiles_the_decode_step_over_an_int8_cache(tmp_path) -> None:
    """An int8 engine's warm-up readies the decoder stack over int8 pools and their scales
    (its first decode step would compile it otherwise), under a marker of its own."""
    env = os.environ | {"PAGEDKV_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-c", _INT8_PROBE]
    result = subprocess.run(run, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr
    # the pools [layers, slots, kv heads, D] int8, their scales as float16 bits
    assert "Array(int8, 4, 'C'" in result.stdout and "Array(uint16, 3, 'C'" in result.stdout
    assert "compiling" in result.stderr
    assert list(tmp_path.glob("cpu-kernels/*/compiled-runtime-bfloat16-kv-int8"))
