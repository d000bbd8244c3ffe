"""Scatter new tokens' K/V rows into their cache slots (one program per token), and the
device and stride checks every kernel of the backend relies on."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedkv.ops import checks
from pagedkv.ops.triton.indexing import scale_args

# Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an integer,
# ties to even, as `torch.round` (`pagedkv.ops.quantize`).
_ROUNDER = tl.constexpr(12582912.0)
# Triton decides when each kernel is defined, that is when this package is imported,
# whether it compiles the kernel for a GPU or interprets it on CPU tensors.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_device(device: torch.device) -> None:
    """Refuse tensors the kernels cannot run on: they compile for CUDA, and interpret on the
    CPU only where ``TRITON_INTERPRET=1`` was set before this package was first imported.

    Raises:
        ValueError: `device` is not a CUDA device and the kernels are compiled.
    """
    if device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            "backend: expected CUDA tensors for backend 'triton' (or TRITON_INTERPRET=1 set "
            f"before triton is first imported, to interpret it on the CPU), got device {device}"
        )


@triton.jit
def _quantized(rows):
    """rows (H, D) float32 -> (int8 rows, float16 scales (H,)), as `quantize`."""
    amax = tl.max(tl.abs(rows), 1)
    scales = tl.minimum(amax / 127.0, 65504.0).to(tl.float16)
    s = scales.to(tl.float32)[:, None]
    q = tl.where(s > 0, rows / tl.where(s > 0, s, 1.0), 0.0)
    q = (q + _ROUNDER) - _ROUNDER
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), scales


@triton.jit
def _write_kv_kernel(
    key, value, key_cache, value_cache, slot_mapping, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
    key_scales, value_scales, stride_sb, stride_st, stride_sh,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # The token's row [num_kv_heads, head_dim] is contiguous in an NHD cache: one store.
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
    dst = dst + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZED:
        # padded lanes load 0: they raise no head's max
        scale_at = (slot // block_size) * stride_sb + (slot % block_size) * stride_st
        scale_at = scale_at + heads * stride_sh
        k, k_scale = _quantized(k.to(tl.float32))
        v, v_scale = _quantized(v.to(tl.float32))
        tl.store(key_scales + scale_at, k_scale, mask=heads < NUM_KV_HEADS)
        tl.store(value_scales + scale_at, v_scale, mask=heads < NUM_KV_HEADS)
    tl.store(key_cache + dst, k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(value_cache + dst, v.to(value_cache.dtype.element_ty), mask=mask)


def write_meta(*, num_kv_heads: int, head_dim: int, quantized: bool = False) -> dict:
    """Compile-time parameters and launch options of `_write_kv_kernel`."""
    return dict(
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        QUANTIZED=quantized, num_warps=4,
    )  # fmt: skip


def check_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Every kernel here addresses both pools with the key pool's strides, and a head's
    elements as adjacent (a layer's caches are checked again per call: only the first
    layer's went through the public checks when the step was planned)."""
    if key_cache.stride() != value_cache.stride():
        raise ValueError(
            "expected key_cache and value_cache with equal strides, "
            f"got {key_cache.stride()} and {value_cache.stride()}"
        )
    if key_cache.stride(-1) != 1:
        raise ValueError(f"expected caches with unit stride in head_dim, got {key_cache.stride()}")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """See `AttentionBackend.write_kv`: one launch; the slots' values are checked only on
    CPU tensors (under the interpreter), where a GPU would have to sync to read them.

    Raises:
        ValueError: key_cache and value_cache differ in strides, head_dim is strided, the
            kernels cannot run on this device, or a slot of a CPU batch lies past the cache.
    """
    check_device(key_cache.device)
    check_strides(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if slot_mapping.is_cpu:
        checks.check_slots_fit(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    key_scales, value_scales, scale_strides = scale_args(key_cache, scales)
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_scales, value_scales, *scale_strides,
        **write_meta(num_kv_heads=num_kv_heads, head_dim=head_dim, quantized=scales is not None),
    )  # fmt: skip
