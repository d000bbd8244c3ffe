"""PagedKVCache: the per-layer key/value block pools, plus an optional host pool for swapping.

Memory layout (one allocation per pool, so that a copy or swap of many blocks across all
layers is one indexed copy)::

    device pool  [2, layers_per_group, num_blocks, block_size, num_kv_heads, head_dim]
                  K/V  slot            block_id    row (slot % block_size)
    key_caches[l]   = pool[0, slot(l)]   contiguous [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches[l] = pool[1, slot(l)]

Layers form KV cache groups (`pagedkv.memory.groups`): a block id belongs to one group and
covers its layers only, layer l being row `slot(l)` of its group's blocks and reading them
through its group's block tables (`group_of[l]`). A model with one kind of layer is one
group of every layer (slot(l) = l). This class is where layers map to storage.

The host pool has the same layout with `num_host_blocks` blocks (pinned memory on CUDA).

An int8 cache (``dtype=torch.int8``) stores each token's K and V rows quantized, and beside
the data pool a scale pool under the same block ids, one scale per token and KV head::

    scale pool  [2, layers_per_group, num_blocks, block_size, num_kv_heads]   float16
    key_scales[l] = scales[0, slot(l)]    value_scales[l] = scales[1, slot(l)]

Row x of a head is stored as ``round(x / s)`` in [-127, 127] with ``s = max|x| / 127``
(`pagedkv.ops.quantize`), computed as the row is written. A float16 scale, not float32:
it adds 2 bytes to the 64 of a head_dim-64 row, against 4, and its 11-bit mantissa is
finer than the int8 steps it scales. Every copy, swap and eviction moves a block's data
and scales together (`_move_blocks`), so a block id names both.

On the CPU the device pool asks the kernel for 2 MiB pages (`huge_pages`): a decode step
reads each sequence's blocks scattered over the pool, and with 4 KiB pages the jump to every
block misses the TLB; on 2 MiB pages blocks of 16 rows read about as fast as blocks of 32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedkv.cache.huge_pages import empty_on_huge_pages
from pagedkv.memory.groups import KVGroups, group_layers
from pagedkv.memory.sequence import positive_int

QUANTIZED_DTYPE = torch.int8
"""The quantized storage dtype: a cache of it holds a scale per token and KV head."""
SCALE_DTYPE = torch.float16
"""The dtype of those scales."""

# The supported dtypes by name (the model loader's too).
DTYPES_BY_NAME = {
    **dict.fromkeys(("float32", "fp32", "float"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16", "half"), torch.float16),
}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if dtype in ("int8", QUANTIZED_DTYPE):
        return QUANTIZED_DTYPE
    if isinstance(dtype, str):
        if dtype not in DTYPES_BY_NAME:
            names = sorted([*DTYPES_BY_NAME, "int8"])
            raise ValueError(f"dtype: expected one of {names}, got {dtype!r}")
        return DTYPES_BY_NAME[dtype]
    if dtype not in DTYPES_BY_NAME.values():
        raise ValueError(f"dtype: expected float32, bfloat16, float16 or int8, got {dtype}")
    return dtype


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled device pool; on the CPU on huge pages, written once here so that its
    pages are committed up front, as by `torch.zeros`."""
    if device.type == "cpu":
        memory = empty_on_huge_pages(math.prod(shape) * dtype.itemsize)
        return memory.view(dtype).view(shape).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled host pool, pinned where it backs a CUDA pool."""
    pin = device.type == "cuda" and shape[2] > 0
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)


class PagedKVCache:
    """Key and value block pools for every layer, on one device, with an optional host pool.

    Attributes:
        key_caches: per layer [num_blocks, block_size, num_kv_heads, head_dim] views.
        value_caches: per layer, same shape.
        key_scales, value_scales: per layer [num_blocks, block_size, num_kv_heads] float16
            views for an int8 cache; None per layer otherwise.
        groups: the layers' KV cache groups (`KVGroups`); `group_of[l]` is layer l's.
        num_layers, num_blocks, block_size, num_kv_heads, head_dim, num_host_blocks, dtype, device.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        num_host_blocks: int = 0,
        sliding_windows: Sequence[int | None] = (),
    ) -> None:
        """Allocate the pools (zero-filled).

        Args:
            dtype: float32, bfloat16, float16, or int8 (quantized, with scales).
            sliding_windows: per layer its window (None: full attention), which groups the
                layers (`group_layers`); empty: one group of every layer.

        Raises:
            ValueError: a size is not a positive int, the dtype is unsupported, or
                `sliding_windows` is neither empty nor one entry per layer.
        """
        self.num_layers = positive_int("num_layers", num_layers)
        self.groups: KVGroups = group_layers(sliding_windows, num_layers)
        self.group_of = [self.groups.slot_of(layer)[0] for layer in range(num_layers)]
        slots = [self.groups.slot_of(layer)[1] for layer in range(num_layers)]
        num_slots = self.groups.layers_per_group
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.num_host_blocks = positive_int("num_host_blocks", num_host_blocks, minimum=0)
        self.dtype = _as_dtype(dtype)
        self.device = torch.device(device)
        self.is_quantized = self.dtype == QUANTIZED_DTYPE
        # (data, scales) shapes of one block: the pools are [2, slots, blocks, *shape]
        block_shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
            ((block_size, num_kv_heads, head_dim), self.dtype)
        ]
        if self.is_quantized:
            block_shapes.append(((block_size, num_kv_heads), SCALE_DTYPE))
        self._pools = [
            _zeros((2, num_slots, num_blocks, *shape), dtype, self.device)
            for shape, dtype in block_shapes
        ]
        self._host_pools = [
            _host_zeros((2, num_slots, num_host_blocks, *shape), dtype, self.device)
            for shape, dtype in block_shapes
        ]
        self._pool = self._pools[0]
        keys, values = self._pool[0].unbind(0), self._pool[1].unbind(0)
        self.key_caches: list[torch.Tensor] = [keys[slot] for slot in slots]
        self.value_caches: list[torch.Tensor] = [values[slot] for slot in slots]
        scales = self._pools[1] if self.is_quantized else None
        self.key_scales: list[torch.Tensor | None] = (
            [scales[0, slot] for slot in slots] if scales is not None else [None] * num_layers
        )
        self.value_scales: list[torch.Tensor | None] = (
            [scales[1, slot] for slot in slots] if scales is not None else [None] * num_layers
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
    ) -> int:
        """Bytes of one block: 2 (K, V) x layers (those of one group: `layers_per_group`) x
        block_size x heads x (dim x elem, plus a scale's bytes for int8)."""
        dtype = _as_dtype(dtype)
        per_head = head_dim * dtype.itemsize
        if dtype == QUANTIZED_DTYPE:
            per_head += SCALE_DTYPE.itemsize
        return 2 * num_layers * block_size * num_kv_heads * per_head

    @classmethod
    def num_blocks_for_memory(
        cls,
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
    ) -> int:
        """How many whole blocks fit in `memory_bytes` (rounded down).

        Raises:
            ValueError: `memory_bytes` is negative.
        """
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes: expected >= 0, got {memory_bytes}")
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return int(memory_bytes) // per_block

    @property
    def key_pool(self) -> torch.Tensor:
        """Every slot's key blocks: [layers_per_group, num_blocks, block_size, num_kv_heads,
        head_dim], contiguous (`key_caches[l]` is its row slot(l); with one group, row l)."""
        return self._pool[0]

    @property
    def value_pool(self) -> torch.Tensor:
        """Every layer's value blocks, as `key_pool`."""
        return self._pool[1]

    @property
    def key_scale_pool(self) -> torch.Tensor | None:
        """Every slot's key scales, [layers_per_group, num_blocks, block_size, num_kv_heads]
        float16, for an int8 cache; else None."""
        return self._pools[1][0] if self.is_quantized else None

    @property
    def value_scale_pool(self) -> torch.Tensor | None:
        """Every layer's value scales, as `key_scale_pool`."""
        return self._pools[1][1] if self.is_quantized else None

    @property
    def num_bytes(self) -> int:
        """Bytes held by the device pools (data and scales)."""
        return sum(pool.numel() * pool.element_size() for pool in self._pools)

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        # (2, S, N, *block) -> (2 * S, N, block elements): a block is one row per (K/V, slot)
        return pool.view(2 * pool.shape[1], pool.shape[2], -1)

    def _move_blocks(
        self,
        sources: list[torch.Tensor],
        destinations: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        """Copy blocks `src` of each source pool to blocks `dst` of its destination pool
        (data, then scales: a block's bytes move together). Every source is read before
        its destination is written, in one gather and one scatter per pool."""
        for source, destination in zip(sources, destinations, strict=True):
            gathered = self._flat(source).index_select(1, src.to(source.device))
            if destination.device.type == "cuda" and gathered.device.type == "cpu":
                gathered = gathered.pin_memory().to(destination.device, non_blocking=True)
            flat = self._flat(destination)
            flat.index_copy_(1, dst.to(destination.device), gathered.to(destination.device))

    def _indices(
        self, pairs: list[tuple[int, int]], src_limit: int, dst_limit: int, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src = [int(p[0]) for p in pairs]
        dst = [int(p[1]) for p in pairs]
        for name, ids, limit in (("source", src, src_limit), ("destination", dst, dst_limit)):
            bad = [i for i in ids if not 0 <= i < limit]
            if bad:
                raise ValueError(f"{what}: expected {name} block ids in [0, {limit}), got {bad[0]}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"{what}: expected distinct destination blocks, got {dst}")
        return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V, data and scales) from `src` to `dst`
        (copy-on-write).

        All sources are read before any destination is written, in one gather and one scatter.

        Args:
            pairs: (src block id, dst block id); destinations distinct.

        Raises:
            ValueError: an id is out of range or a destination repeats.
        """
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_blocks, self.num_blocks, "copy_blocks")
        self._move_blocks(self._pools, self._pools, src, dst)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (all layers, K and V, data and scales).

        Args:
            pairs: (device block id, host block id); host ids distinct.

        Raises:
            ValueError: an id is out of range or a host block repeats.
        """
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
        self._move_blocks(self._pools, self._host_pools, src, dst)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back into device blocks (all layers, K and V, data and scales).

        Args:
            pairs: (host block id, device block id); device ids distinct.

        Raises:
            ValueError: an id is out of range or a device block repeats.
        """
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
        self._move_blocks(self._host_pools, self._pools, src, dst)

    @property
    def bytes_per_stored_block(self) -> int:
        """Bytes of one block as `read_blocks` gives it (its layers' K and V, and scales)."""
        shape = (self.groups.layers_per_group, self.block_size, self.num_kv_heads, self.head_dim)
        return self.bytes_per_block(*shape, self.dtype)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy whole blocks out of the device pools: the one way a block's bytes leave them.

        Args:
            block_ids: device block ids.

        Returns:
            uint8 [len(block_ids), bytes_per_stored_block] on the CPU, a copy: row i holds
            block ``block_ids[i]``'s K and V of every slot in pool order (K slot 0 .. K slot
            S-1, V slot 0 .. V slot S-1), then its scales in the same order (int8).

        Raises:
            ValueError: an id is out of range.
        """
        pairs = [(b, i) for i, b in enumerate(block_ids)]
        ids, _ = self._indices(pairs, self.num_blocks, len(pairs), "read_blocks")
        parts = []
        for pool in self._pools:
            rows = self._flat(pool).index_select(1, ids.to(self.device))  # (2S, n, elements)
            rows = rows.transpose(0, 1)  # (n, 2S, elements)
            # From a GPU into page-locked memory: a pageable destination stages every copy.
            on_gpu = rows.device.type == "cuda"
            rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=on_gpu).copy_(rows)
            parts.append(rows.view(torch.uint8).view(len(block_ids), -1))
        return torch.cat(parts, dim=1)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks that `read_blocks` gave (of this pool's layout and dtype).

        Args:
            block_ids: distinct device block ids.
            data: uint8 [len(block_ids), bytes_per_stored_block] on the CPU.

        Raises:
            ValueError: an id is out of range or repeats, or `data` has another shape.
        """
        expected = (len(block_ids), self.bytes_per_stored_block)
        if data.dtype != torch.uint8 or tuple(data.shape) != expected:
            raise ValueError(
                f"write_blocks: expected uint8 data of shape {expected}, "
                f"got {data.dtype} {tuple(data.shape)}"
            )
        pairs = [(i, b) for i, b in enumerate(block_ids)]
        _, ids = self._indices(pairs, len(pairs), self.num_blocks, "write_blocks")
        start = 0
        for pool in self._pools:
            flat = self._flat(pool)
            width = flat.shape[0] * flat.shape[2] * pool.element_size()
            part = data[:, start : start + width].contiguous().view(pool.dtype)
            rows = part.view(len(block_ids), flat.shape[0], -1).transpose(0, 1)
            flat.index_copy_(1, ids.to(self.device), rows.to(self.device))
            start += width

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"num_host_blocks={self.num_host_blocks}, groups={self.groups.num_groups})"
        )
