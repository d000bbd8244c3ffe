"""Compile the kernels for an NVIDIA GPU on any machine and report their resources.

No GPU is needed: Triton lowers to PTX and its bundled ``ptxas`` assembles a cubin,
whose register count, spill (stack) bytes and shared memory ``cuobjdump`` reads. This
catches what the interpreter cannot (code that does not compile, register spills,
loads that are not pipelined) and is the evidence behind the speed notes in
``pagedkv/ops/triton/decode.py`` and ``prefill.py``; tests/ops/test_triton_compile.py
asserts on its reports. A developer's tool, so it lives beside the benchmarks, not in the
package. Run without ``TRITON_INTERPRET``::

    python benchmarks/triton_compile_check.py --dtype bf16 --block-size 16 --group 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedkv.ops import triton as backend
from pagedkv.ops.triton import decode, prefill, write

_DATA_POINTERS = {"query", "key_cache", "value_cache", "out", "key", "value"}
_TYPED_POINTERS = {
    "block_tables": "*i32", "seq_lens": "*i32", "query_start_loc": "*i32",
    "slot_mapping": "*i64", "part_max": "*fp32", "part_sum": "*fp32", "part_acc": "*fp32",
    "key_scales": "*fp16", "value_scales": "*fp16",
}  # fmt: skip
# Integers the runtime sees as multiples of 16 in real use (it specializes on that).
_ALIGNED_INTS = {"partition_size", "block_size"}


@dataclass
class KernelReport:
    """Resources of one compiled kernel (None where cuobjdump is unavailable)."""

    name: str
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int
    async_copies: int  # cp.async copies in the pipelined loop (0: loads not pipelined)
    tensor_core_ops: int  # mma / wgmma instructions in the PTX


def _compile(
    fn: Any, constexprs: dict, dtype: str, arch: int, tag: str, int8_kv: bool = False
) -> KernelReport:
    if not hasattr(fn, "arg_names") or not hasattr(fn, "parse"):
        raise RuntimeError(
            "expected compiled-mode kernels, got interpreted ones (unset TRITON_INTERPRET)"
        )
    rows = constexprs.get("BLOCK_Q", 1) * constexprs.get("GROUP_PAD", 1)
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = (
            "*i8" if int8_kv and arg in ("key_cache", "value_cache")
            else f"*{dtype}" if arg in _DATA_POINTERS
            else _TYPED_POINTERS.get(arg, "fp32" if arg == "scale_log2" else "i32")
        )  # fmt: skip
        if signature[arg].startswith("*") or arg.startswith("stride") or arg in _ALIGNED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, spill = _resource_usage(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    return KernelReport(
        name=f"{fn.__name__}[{tag}/m{rows}]",
        registers=registers,
        spill_bytes=spill,
        shared_bytes=kernel.metadata.shared,
        async_copies=kernel.asm["ttgir"].count("async_copy_global_to_local"),
        tensor_core_ops=len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)", ptx)),
    )


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def compile_kernels(
    *,
    dtype: str = "bf16",
    block_size: int = 16,
    group: int = 4,
    head_dim: int = 128,
    num_kv_heads: int = 8,
    use_window: bool = False,
    arch: int = 90,
    int8_kv: bool = False,
) -> list[KernelReport]:
    """Compile decode (split), reduce, prefill (both tile heights) and write kernels.

    Args:
        dtype: "bf16" | "fp16" | "fp32".  block_size, group, head_dim, num_kv_heads: the model.
        use_window: compile the sliding-window variants.  arch: compute capability x10.
        int8_kv: the variants over an int8 cache with float16 scales.

    Raises:
        RuntimeError: the kernels were defined under ``TRITON_INTERPRET=1``.
    """
    is_fp32 = dtype == "fp32"
    decode_tile = backend.tile_blocks_for(block_size, backend._DECODE_TILE_LANES)
    prefill_tile = backend.tile_blocks_for(block_size, backend._PREFILL_TILE_LANES)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    tag = f"{dtype}/bs{block_size}/g{group}/d{head_dim}"
    tag += "/int8kv" if int8_kv else ""
    common: dict[str, Any] = dict(
        is_fp32=is_fp32, group=group, head_dim=head_dim, block_size=block_size, quantized=int8_kv
    )
    # Both prefill tile heights: a batch of short chunks (64 rows) and long prompts (128).
    short_m = backend.prefill_block_m(torch_dtype, 1, 1, group, block_size)
    long_m = backend.prefill_block_m(torch_dtype, 4096, 1, group, block_size)
    jobs = [
        (decode._decode_kernel, decode.decode_meta(
            **common, tile_blocks=decode_tile, use_window=use_window, is_split=True)),
        (decode._reduce_kernel, decode.reduce_meta(head_dim=head_dim, num_parts=64)),
        *((prefill._prefill_kernel, prefill.prefill_meta(
            **common, block_m=block_m, tile_blocks=prefill_tile, use_window=use_window))
          for block_m in sorted({short_m, long_m})),
        (write._write_kv_kernel, write.write_meta(num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                  quantized=int8_kv)),
    ]  # fmt: skip
    return [_compile(fn, meta, dtype, arch, tag, int8_kv) for fn, meta in jobs]


def main(argv: list[str] | None = None) -> None:
    """Print one JSON line per kernel."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", action="store_true")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    reports = compile_kernels(
        dtype=args.dtype, block_size=args.block_size, group=args.group,
        head_dim=args.head_dim, use_window=args.window, arch=args.arch,
    )  # fmt: skip
    for report in reports:
        print(json.dumps(asdict(report)))


if __name__ == "__main__":
    main()
