"""A Llama-family decoder stack for a decode step of a few rows: every layer in one call.

At batch 1 a step's arithmetic is small (each weight is read once) and driving ~15 torch
operations and kernel calls per layer from Python costs about as much as the products.
Here the whole stack runs in compiled code, layer by layer, as `pagedkv.models.llama`
computes it:

    n = rms_norm(x);  q|k|v = qkv_proj(n);  q, k = rotary(qk_norm(q), qk_norm(k))
    write k, v at the rows' slots;  x += o_proj(attention(q, the paged cache))
    n = rms_norm(x);  gate|up = gate_up_proj(n);  x += down_proj(silu(gate) * up)

In bfloat16 every value is rounded where torch rounds it (after each operation), sums
run in float32; products and attention are `matvec.py`'s and `kernels.py`'s own. The
final norm and the LM head stay with the model.

NumPy and Numba only (tensors arrive as NumPy views, bfloat16 as uint16 bits), loaded
through `pagedkv.kernel_cache` with the two kernel files it calls.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagedkv import kernel_cache
from pagedkv.ops.cpu.bf16 import as_float32

_kernels = kernel_cache.load_kernels()
_matvec = kernel_cache.load_kernels("matvec")
_narrow = _matvec.narrow


@njit(cache=True, fastmath=True)
def decode_layers(
    x, cos, sin, num_real, slots, in_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, post_norm,
    gate_up, down, key_pool, value_pool, block_tables, items, row_items, block_size, eps,
    scale, parts, min_work,
    parallel_attention,
):  # fmt: skip  # pragma: no cover
    """Pass x through every layer, in place; write each layer's K/V of the real rows.

    Args:
        x: [T, hidden] hidden states (rows past `num_real` only pad the products).
        cos, sin: [T, head_dim // 2], x's dtype.  slots: int64 [num_real], -1 to skip.
        in_norm, post_norm: per layer [hidden].  qkv: per layer [(H + 2 KV) * D, hidden],
            qkv_bias [(H + 2 KV) * D] or empty.  q_norm, k_norm: per layer [D] or empty.
        o_proj: [hidden, H * D].  gate_up: [2 I, hidden].  down: [hidden, I].  (Numba
            typed lists, one entry per layer, x's dtype.)
        key_pool, value_pool: [L, num_slots, KV, D], x's dtype.
        block_tables, items, row_items: the step's `CpuPlan` (every real row a kernel row).
        block_size: tokens per block of the pools.
        eps, scale: RMSNorm epsilon and softmax scale.
        parts, min_work: a product of at least `min_work` multiply-adds (rows x weight
            elements) is split over `parts` threads, a smaller one runs on the calling one.
        parallel_attention: attention items over every thread.
    """
    rows, hidden = x.shape
    num_kv_heads, head_dim = key_pool.shape[2], key_pool.shape[3]
    num_heads = o_proj[0].shape[1] // head_dim
    q_size = num_heads * head_dim
    normed = np.empty_like(x)
    fused = np.empty((rows, qkv[0].shape[0]), dtype=x.dtype)
    query = np.empty((num_real, num_heads, head_dim), dtype=np.float32)
    attended = np.empty((num_real, num_heads, head_dim), dtype=np.float32)
    heads_out = np.zeros((rows, q_size), dtype=x.dtype)  # padding rows stay 0
    update = np.empty_like(x)
    mlp_in = np.empty((rows, gate_up[0].shape[0]), dtype=x.dtype)
    mlp_mid = np.empty((rows, down[0].shape[1]), dtype=x.dtype)
    empty = qkv_bias[0][:0]
    for layer in range(len(qkv)):
        for r in range(rows):
            _rms_norm(x[r], in_norm[layer], eps, normed[r])
        _product(normed, qkv[layer], qkv_bias[layer], fused, parts, min_work)
        for r in range(rows):
            for h in range(num_heads + num_kv_heads):
                head = fused[r, h * head_dim : (h + 1) * head_dim]
                norm = q_norm[layer] if h < num_heads else k_norm[layer]
                if norm.shape[0]:
                    _rms_norm(head, norm, eps, head)
                _rotate(head, cos[r], sin[r])
        keys, values = key_pool[layer], value_pool[layer]
        for r in range(num_real):
            if slots[r] >= 0:
                for g in range(num_kv_heads):
                    k0 = q_size + g * head_dim
                    v0 = q_size + (num_kv_heads + g) * head_dim
                    keys[slots[r], g, :] = fused[r, k0 : k0 + head_dim]
                    values[slots[r], g, :] = fused[r, v0 : v0 + head_dim]
            for h in range(num_heads):
                for d in range(head_dim):
                    query[r, h, d] = as_float32(fused[r, h * head_dim + d])
        if parallel_attention:
            _kernels.decode_parallel(query, keys, values, block_tables, items, row_items,
                                     block_size, scale, attended)  # fmt: skip
        else:
            _kernels.decode_serial(query, keys, values, block_tables, items, row_items,
                                   block_size, scale, attended)  # fmt: skip
        for r in range(num_real):
            for h in range(num_heads):
                for d in range(head_dim):
                    heads_out[r, h * head_dim + d] = _narrow(attended[r, h, d], x)
        _product(heads_out, o_proj[layer], empty, update, parts, min_work)
        _add(x, update)
        for r in range(rows):
            _rms_norm(x[r], post_norm[layer], eps, normed[r])
        _product(normed, gate_up[layer], empty, mlp_in, parts, min_work)
        size = mlp_mid.shape[1]
        for r in range(rows):
            for i in range(size):
                gate = as_float32(mlp_in[r, i])
                act = as_float32(_narrow(gate / (np.float32(1.0) + np.exp(-gate)), x))
                mlp_mid[r, i] = _narrow(act * as_float32(mlp_in[r, size + i]), x)
        _product(mlp_mid, down[layer], empty, update, parts, min_work)
        _add(x, update)


@njit(cache=True, fastmath=True)
def _product(x, weight, bias, out, parts, min_work):  # pragma: no cover
    if parts > 1 and x.shape[0] * weight.size >= min_work:
        _matvec.matvec_parallel(x, weight, bias, out, parts)
    else:
        _matvec.matvec(x, weight, bias, out)


@njit(cache=True, fastmath=True)
def _add(x, update):  # pragma: no cover
    """x += update (a residual), rounded to x's dtype."""
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[r, i] = _narrow(as_float32(x[r, i]) + as_float32(update[r, i]), x)


@njit(cache=True, fastmath=True)
def _rms_norm(x, weight, eps, out):  # pragma: no cover
    """out = weight * (x / sqrt(mean(x^2) + eps)); out may be x. In bfloat16 the normalized
    value is rounded before the weight multiplies it (`models.layers.RMSNorm`)."""
    total = np.float32(0.0)
    for i in range(x.shape[0]):
        total += as_float32(x[i]) * as_float32(x[i])
    inv = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[0]) + np.float32(eps))
    for i in range(x.shape[0]):
        normed = as_float32(_narrow(as_float32(x[i]) * inv, x))
        out[i] = _narrow(as_float32(weight[i]) * normed, x)


@njit(cache=True, fastmath=True)
def _rotate(head, cos, sin):  # pragma: no cover
    """Neox-style rotary of one head in place (`models.layers.apply_rotary_`'s roundings)."""
    half = cos.shape[0]
    for i in range(half):
        a, b = as_float32(head[i]), as_float32(head[half + i])
        c, s = as_float32(cos[i]), as_float32(sin[i])
        head[i] = _narrow(as_float32(_narrow(a * c, head)) - b * s, head)
        head[half + i] = _narrow(as_float32(_narrow(b * c, head)) + a * s, head)
