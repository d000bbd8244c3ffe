"""The decoder stack's operations on a step's rows between its products (`stack.py`): RMSNorm,
rotary and the K/V writes of a head of q|k|v, the MLP's activation, the merge of attention
items. Each rounds where torch rounds in `pagedkv.models.llama` (bfloat16 values as uint16
bits, sums in float32). NumPy and Numba only; compiled code cached as
`pagedkv.runtime.kernel_cache` says.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagedkv.ops.cpu.bf16 import as_float32, bits_as_float32
from pagedkv.ops.cpu.int8 import store_row
from pagedkv.ops.cpu.kernels import EXACT_ORDER, exp_parts, merge_row
from pagedkv.runtime import kernel_cache
from pagedkv.runtime.matvec import narrow

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator


@njit(cache=True, fastmath=True)
def place_head(h, fused, q_norm, k_norm, cos, sin, eps, num_real, slots, query,
                cache):  # fmt: skip  # pragma: no cover
    """After head h of q|k|v is computed: norm and rotate a q or k head, then put q into
    `query` (float32), k and v at the rows' slots of the layer's cache, (keys, values,
    key_scales, value_scales) (quantized where the scales are arrays)."""
    keys, values, key_scales, value_scales = cache
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = keys.shape[1]
    for r in range(fused.shape[0]):
        head = fused[r, h * head_dim : (h + 1) * head_dim]
        if h < num_heads + num_kv_heads:
            norm = q_norm if h < num_heads else k_norm
            if norm.shape[0]:
                rms_norm(head, norm, eps, head)
            _rotate(head, cos[r], sin[r])
        if r >= num_real:
            continue
        if h < num_heads:
            for d in range(head_dim):
                query[r, h, d] = as_float32(head[d])
        elif slots[r] >= 0 and h < num_heads + num_kv_heads:
            store_row(keys, key_scales, slots[r], h - num_heads, head)
        elif slots[r] >= 0:
            store_row(values, value_scales, slots[r], h - num_heads - num_kv_heads, head)


@njit(cache=True, fastmath=True)
def norm_rows(x, weight, eps, normed):  # pragma: no cover
    """normed = rms_norm(x) row by row."""
    for r in range(x.shape[0]):
        rms_norm(x[r], weight, eps, normed[r])


@njit(cache=True, error_model="numpy", fastmath=True)
def silu_rows(mlp_in, mid, x, scratch):  # pragma: no cover
    """mid = silu(gate) * up, down's input (gate|up = mlp_in), each rounded to x's dtype
    where torch rounds (after the activation, after the product).

    silu(g) = g / (1 + exp(-g)), computed as g / (1 + e) for g >= 0 and g e / (1 + e)
    below, with e = exp(-|g|) <= 1 from the attention kernel's vectorized exp
    (`kernels.exp_parts`; libm's expf is a scalar call per element). Three loops, each of
    which LLVM vectorizes, and NumPy's error model: Python's checks every division for zero,
    a branch that kept the loop scalar."""
    size = mid.shape[1]
    for r in range(mid.shape[0]):
        for j in range(size):
            fraction, bits = exp_parts(-abs(as_float32(mlp_in[r, j])))
            scratch[j] = fraction * bits_as_float32(np.uint32(bits))
        for j in range(size):
            gate, e = as_float32(mlp_in[r, j]), scratch[j]
            act = (gate if gate >= 0 else gate * e) / (np.float32(1) + e)
            scratch[j] = as_float32(narrow(act, x))
        for j in range(size):
            mid[r, j] = narrow(scratch[j] * as_float32(mlp_in[r, size + j]), x)


@njit(cache=True, fastmath=True)
def merge_rows(num_real, row_items, acc, row_max, row_sum, attended, heads, x):  # pragma: no cover
    """heads = each real row's attention items merged (into `attended`), rounded to x's
    dtype, [rows, H * D] as o_proj reads them (pad rows left as they are)."""
    for r in range(num_real):
        merge_row(r, row_items, acc, row_max, row_sum, attended)
        flat = attended[r].reshape(heads.shape[1])
        for i in range(flat.shape[0]):
            heads[r, i] = narrow(flat[i], x)


@njit(cache=True, fastmath=EXACT_ORDER)
def rms_norm(x, weight, eps, out):  # pragma: no cover
    """out = weight * (x / sqrt(mean(x^2) + eps)); out may be x. In bfloat16 the normalized
    value is rounded before the weight multiplies it (`models.layers.RMSNorm`). The squares
    are summed in four lanes added in a fixed order (`kernels.EXACT_ORDER`)."""
    size = x.shape[0]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for i in range(0, size - 3, 4):
        a, b = as_float32(x[i]), as_float32(x[i + 1])
        c, d = as_float32(x[i + 2]), as_float32(x[i + 3])
        s0, s1, s2, s3 = s0 + a * a, s1 + b * b, s2 + c * c, s3 + d * d
    for i in range(size - size % 4, size):
        s0 += as_float32(x[i]) * as_float32(x[i])
    total = (s0 + s1) + (s2 + s3)
    inv = np.float32(1.0) / np.sqrt(total / np.float32(size) + np.float32(eps))
    for i in range(x.shape[0]):
        normed = as_float32(narrow(as_float32(x[i]) * inv, x))
        out[i] = narrow(as_float32(weight[i]) * normed, x)


@njit(cache=True, fastmath=True)
def _rotate(head, cos, sin):  # pragma: no cover
    """Neox-style rotary of one head in place (`models.layers.apply_rotary_`'s roundings)."""
    half = cos.shape[0]
    for i in range(half):
        a, b = as_float32(head[i]), as_float32(head[half + i])
        c, s = as_float32(cos[i]), as_float32(sin[i])
        head[i] = narrow(as_float32(narrow(a * c, head)) - b * s, head)
        head[half + i] = narrow(as_float32(narrow(b * c, head)) + a * s, head)
