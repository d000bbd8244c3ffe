"""A decode step of a few rows through the whole decoder stack in one compiled call and one
parallel region (`decode_layers`, `stack.py`), bound by reading the weights once; it reads
the plans of the CPU attention backend (`pagedkv.ops.cpu`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.ops import AttentionMetadata, checks, cpu
from pagedkv.ops.cpu import CpuPlan
from pagedkv.ops.cpu.arrays import as_numpy, checked_slots, sync_threads
from pagedkv.ops.quantize import KVScales
from pagedkv.runtime import kernel_cache, stack
from pagedkv.runtime.phase_products import BlockParts, block_parts, num_rows, without_rows
from pagedkv.runtime.products import linear_rows
from pagedkv.runtime.quant.formats import FORMATS
from pagedkv.runtime.quant.weight import QuantPart, QuantWeight
from pagedkv.runtime.tuning import CpuTuning


@dataclass
class DecoderWeights:
    """A decoder stack's weights as `decode_layers` reads them: per role, one Numba typed
    list of NumPy views (no copies), entry l for layer l; absent ones (a bias, q/k norms)
    as empty arrays; then the final norm's and the LM head's. The projections and the
    head are all plain or all in GGML blocks (`phase_products.block_parts`)."""

    in_norm: Sequence[np.ndarray]
    qkv: Sequence[np.ndarray | BlockParts]
    qkv_bias: Sequence[np.ndarray]
    q_norm: Sequence[np.ndarray]
    k_norm: Sequence[np.ndarray]
    o_proj: Sequence[np.ndarray | BlockParts]
    post_norm: Sequence[np.ndarray]
    gate_up: Sequence[np.ndarray | BlockParts]
    down: Sequence[np.ndarray | BlockParts]
    final_norm: np.ndarray
    head: np.ndarray | BlockParts
    eps: float
    dtype: torch.dtype

    @classmethod
    def create(
        cls,
        layers: Sequence[dict[str, torch.Tensor | QuantWeight | None]],
        final_norm: torch.Tensor,
        head: torch.Tensor | QuantWeight,
        eps: float,
    ) -> DecoderWeights:
        """layers: per layer a dict of the fields' tensors; final_norm [hidden], head [vocab,
        hidden] (all plain, C-contiguous, one dtype: float32 or bfloat16; None for an absent
        one), the projections and the head either all such tensors or all `QuantWeight`s.
        The tensors and blocks are read in place.

        Raises:
            ValueError: a tensor is not plain in the norms' dtype, or the projections and
                the head mix plain weights and blocks.
        """
        dtype = layers[0]["in_norm"].dtype  # type: ignore[union-attr]
        in_blocks = isinstance(head, QuantWeight)
        fields = {}
        for name in ("in_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "post_norm",
                     "gate_up", "down"):  # fmt: skip
            views = [_view(layer[name], name, dtype, in_blocks) for layer in layers]
            fields[name] = stack.typed_list(tuple(views))
        return cls(
            **fields,
            final_norm=as_numpy(_plain(final_norm, "final_norm", dtype)),
            head=_view(head, "head", dtype, in_blocks),
            eps=eps,
            dtype=dtype,
        )


_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down", "head")


def _view(
    t: torch.Tensor | QuantWeight | None, name: str, dtype: torch.dtype, in_blocks: bool
) -> np.ndarray | BlockParts:
    """A field as the stack reads it: a projection in blocks as its parts, any other tensor
    as a NumPy view."""
    if name in _PROJECTIONS and in_blocks != isinstance(t, QuantWeight):
        expected = "GGML blocks, as the LM head" if in_blocks else "a tensor, as the LM head"
        raise checks.fail(name, expected, type(t).__name__)
    if isinstance(t, QuantWeight):
        return block_parts(t, name)
    return as_numpy(_plain(t, name, dtype))


def _plain(t: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor:
    if t is None:
        return torch.empty(0, dtype=dtype)
    if t.is_mkldnn or t.dtype != dtype or not t.is_contiguous():
        raise checks.fail(name, f"a plain contiguous {dtype} tensor", f"{t.dtype} {t.layout}")
    return t.detach()


def decode_layers(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    weights: DecoderWeights,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    plan: CpuPlan,
    scale: float,
    with_head: bool = True,
    knobs: tuple[int, int, int] = CpuTuning().kernel_knobs(),
    scale_pools: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's rows through every layer, the final norm and the LM head
    (`stack.py`); `hidden` is the residual stream, updated in place.

    Args:
        hidden: [T, hidden_size] in the weights' dtype; rows past the plan's only pad.
        cos, sin: [T, head_dim // 2], hidden's dtype.
        slot_mapping: [num_real] int64 (the plan's rows; -1 skips a row's write).
        key_pool, value_pool: [num_layers, num_blocks, block_size, num_kv_heads, head_dim],
            the weights' dtype, or int8 with `scale_pools`.
        plan: the step's plan over these pools, with every real row a kernel row
            (`CpuPlan.is_decode_only`).
        scale: softmax scale.
        with_head: run the LM head too (else its logits are None, for the caller's matmul).
        knobs: `CpuTuning.kernel_knobs()`.
        scale_pools: (key, value) [num_layers, num_blocks, block_size, num_kv_heads] float16
            scales of int8 pools, else None.

    Returns:
        (the final norm's output [T, hidden_size] in hidden's dtype, float32 logits [T,
        vocab]; a bfloat16 model's are rounded to bfloat16 first, as its matmul gives them).
    """
    if not plan.is_decode_only(slot_mapping.shape[0]):
        raise checks.fail("plan", "kernel rows only (a decode step)", "prefill sequences")
    if key_pool.shape[1:] != plan.cache_shape or key_pool.dtype != plan.dtype:
        raise checks.fail("key_pool", f"layers of {tuple(plan.cache_shape)} (as planned)",
                          tuple(key_pool.shape))  # fmt: skip
    if value_pool.shape != key_pool.shape or value_pool.dtype != key_pool.dtype:
        raise checks.fail("value_pool", f"as key_pool, {tuple(key_pool.shape)}", value_pool.shape)
    for name, t in (("hidden", hidden), ("key_pool", key_pool)):
        if t.dtype != weights.dtype and not (name == "key_pool" and t.dtype == torch.int8):
            raise checks.fail(name, f"the weights' dtype {weights.dtype}", t.dtype)
    key_scales, value_scales = _scale_rows(scale_pools, key_pool)
    slots, _ = checked_slots(slot_mapping, plan.cache_shape[0] * plan.cache_shape[1])
    pool_rows = (key_pool.shape[0], -1, key_pool.shape[3], key_pool.shape[4])
    threads = _team.threads(sync_threads())
    final = torch.empty_like(hidden)
    head = weights.head if with_head else without_rows(weights.head)  # an empty phase
    logits = torch.empty(hidden.shape[0], num_rows(head), dtype=torch.float32)
    went_alone = stack.decode_layers(
        as_numpy(hidden), as_numpy(cos), as_numpy(sin), slot_mapping.shape[0],
        slots.numpy(), weights.in_norm, weights.qkv,
        weights.qkv_bias, weights.q_norm, weights.k_norm, weights.o_proj, weights.post_norm,
        weights.gate_up, weights.down, weights.final_norm, head,
        as_numpy(key_pool.view(pool_rows)), as_numpy(value_pool.view(pool_rows)),
        plan.block_tables, plan.items, plan.row_items, key_pool.shape[2], weights.eps, scale,
        threads, as_numpy(final), logits.numpy(), knobs, key_scales, value_scales,
    )  # fmt: skip
    _team.record(threads, went_alone)
    return final, (logits if with_head else None)


def _scale_rows(
    scale_pools: KVScales | None, key_pool: torch.Tensor
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The int8 pools' scales as the stack reads them, uint16 bits [num_layers, num_slots,
    num_kv_heads] (NumPy views of the whole pools, checked as such); (None, None) beside a
    float cache.

    Raises:
        ValueError: scales beside a float cache, none beside an int8 one, or a pool not
            contiguous float16 of key_pool's [num_layers, num_blocks, block_size, num_kv_heads].
    """
    if (scale_pools is None) != (key_pool.dtype != torch.int8):
        expected = "the scales of the int8 pools" if scale_pools is None else "None"
        raise checks.fail("scale_pools", f"{expected} beside a {key_pool.dtype} cache",
                          None if scale_pools is None else "scales")  # fmt: skip
    if scale_pools is None:
        return None, None
    shape = key_pool.shape[:4]
    rows = []
    for name, t in zip(("key", "value"), scale_pools, strict=True):
        if t.shape != shape or t.dtype != torch.float16 or not t.is_contiguous():
            raise checks.fail(f"scale_pools ({name})", f"contiguous float16 {tuple(shape)}",
                              f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")  # fmt: skip
        rows.append(as_numpy(t).reshape(shape[0], -1, shape[3]))
    return rows[0], rows[1]


class TeamBackoff:
    """How many threads share the next decode step (`stack.py`).

    Where a thread had to finish a step alone, another process holds a core: the next
    steps run on one thread, for twice as many steps each time it happens again (up to
    `MAX_ALONE`), and a step shared without trouble ends the backoff.
    """

    MAX_ALONE = 256

    def __init__(self) -> None:
        self.alone_left = 0
        self.backoff = 0

    def threads(self, available: int) -> int:
        if self.alone_left > 0:
            self.alone_left -= 1
            return 1
        return available

    def record(self, threads: int, went_alone: bool) -> None:
        if threads == 1:
            return
        if went_alone:
            self.backoff = min(self.MAX_ALONE, 2 * self.backoff or 4)
            self.alone_left = self.backoff
        else:
            self.backoff = 0


_team = TeamBackoff()
"""One per process: whether cores are free is the machine's state, not a model's."""


def warmup(dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None) -> None:
    """Load or compile the variants of `dtype` (float32 or bfloat16) of both matrix-vector
    kernels and the decoder stack, the stack's over a `kv_cache_dtype` cache (default
    `dtype`; int8: quantized, with its scales); say so on stderr when they compile."""
    kv_dtype = kv_cache_dtype or dtype
    name = str(dtype).removeprefix("torch.")
    if kv_dtype != dtype:  # its own marker: an engine of the model's dtype built the rest
        name += "-kv-" + str(kv_dtype).removeprefix("torch.")
    kernel_cache.announce(f"runtime-{name}")
    for parallel in (False, True):
        weight = torch.zeros(1, 2, dtype=dtype)
        linear_rows(weight, None, parallel=parallel)(torch.zeros(1, 2, dtype=dtype))
    sizes = {"in_norm": (8,), "qkv": (24, 8), "qkv_bias": (24,), "q_norm": (8,), "k_norm": (8,),
             "o_proj": (8, 8), "post_norm": (8,), "gate_up": (4, 8), "down": (8, 2)}  # fmt: skip
    weights = DecoderWeights.create(
        [{k: torch.zeros(v, dtype=dtype) for k, v in sizes.items()}],
        torch.zeros(8, dtype=dtype), torch.zeros(5, 8, dtype=dtype), 1e-6,
    )  # fmt: skip
    cache = torch.zeros(1, 1, 1, 1, 8, dtype=kv_dtype)
    scale_pools = None
    if kv_dtype == torch.int8:
        scale_pools = (torch.zeros(1, 1, 1, 1, dtype=torch.float16),
                       torch.zeros(1, 1, 1, 1, dtype=torch.float16))  # fmt: skip
    plan = cpu.plan(AttentionMetadata.build([[0]], [1], [1], [0]), cache[0], 1, None)
    row, half = torch.zeros(1, 8, dtype=dtype), torch.zeros(1, 4, dtype=dtype)
    slots = torch.zeros(1, dtype=torch.int64)
    decode_layers(row, half, half, slots, weights, cache, cache.clone(), plan, 1.0,
                  scale_pools=scale_pools)  # fmt: skip
    kernel_cache.mark_compiled(f"runtime-{name}")


def warmup_blocks(dtype: torch.dtype) -> None:
    """Load or compile the decoder stack's variant of `dtype` (float32 or bfloat16) for
    projections in GGML blocks (one for every format: the format is an argument)."""
    name = f"runtime-{str(dtype).removeprefix('torch.')}-blocks"
    kernel_cache.announce(name)
    q8_0 = FORMATS["Q8_0"]

    def blocks(rows: int) -> QuantWeight:
        return QuantWeight([QuantPart(q8_0, np.zeros((rows, q8_0.row_bytes(32)), np.uint8))], 32)

    # hidden 32, four query heads and one K/V head of 8, MLP 32: whole blocks everywhere
    layer: dict[str, torch.Tensor | QuantWeight | None] = {
        "in_norm": torch.zeros(32, dtype=dtype), "qkv": blocks(48), "qkv_bias": None,
        "q_norm": None, "k_norm": None, "o_proj": blocks(32),
        "post_norm": torch.zeros(32, dtype=dtype), "gate_up": blocks(64), "down": blocks(32),
    }  # fmt: skip
    weights = DecoderWeights.create([layer], torch.zeros(32, dtype=dtype), blocks(5), 1e-6)
    cache = torch.zeros(1, 1, 1, 1, 8, dtype=dtype)
    plan = cpu.plan(AttentionMetadata.build([[0]], [1], [1], [0]), cache[0], 4, None)
    row, half = torch.zeros(1, 32, dtype=dtype), torch.zeros(1, 4, dtype=dtype)
    slots = torch.zeros(1, dtype=torch.int64)
    decode_layers(row, half, half, slots, weights, cache, cache.clone(), plan, 1.0)
    kernel_cache.mark_compiled(name)
