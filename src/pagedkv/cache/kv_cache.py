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

# The supported dtypes by name (the model loader's too).
DTYPES_BY_NAME = {
    **dict.fromkeys(("float32", "fp32", "float"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16", "half"), torch.float16),
}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES_BY_NAME:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES_BY_NAME)}, got {dtype!r}")
        return DTYPES_BY_NAME[dtype]
    if dtype not in DTYPES_BY_NAME.values():
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    return dtype


class PagedKVCache:
    """Key and value block pools for every layer, on one device, with an optional host pool.

    Attributes:
        key_caches: per layer [num_blocks, block_size, num_kv_heads, head_dim] views.
        value_caches: per layer, same shape.
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
        block_shape = (block_size, num_kv_heads, head_dim)
        pool_shape = (2, num_slots, num_blocks, *block_shape)
        if self.device.type == "cpu":
            # Written once here so that its pages are committed up front, as by `torch.zeros`.
            memory = empty_on_huge_pages(math.prod(pool_shape) * self.dtype.itemsize)
            self._pool = memory.view(self.dtype).view(pool_shape).zero_()
        else:
            self._pool = torch.zeros(pool_shape, dtype=self.dtype, device=self.device)
        keys, values = self._pool[0].unbind(0), self._pool[1].unbind(0)
        self.key_caches: list[torch.Tensor] = [keys[slot] for slot in slots]
        self.value_caches: list[torch.Tensor] = [values[slot] for slot in slots]
        self._host_pool = torch.zeros(
            (2, num_slots, num_host_blocks, *block_shape),
            dtype=self.dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda" and num_host_blocks > 0,
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
        block_size x heads x dim x elem."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * _as_dtype(dtype).itemsize

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
    def num_bytes(self) -> int:
        """Bytes held by the device pool."""
        return self._pool.numel() * self._pool.element_size()

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        # (2, S, N, bs, H, D) -> (2 * S, N, bs * H * D): a block is one row per (K/V, slot)
        return pool.view(2 * pool.shape[1], pool.shape[2], -1)

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
        """Copy whole blocks (all layers, K and V) from `src` to `dst` (copy-on-write).

        All sources are read before any destination is written, in one gather and one scatter.

        Args:
            pairs: (src block id, dst block id); destinations distinct.

        Raises:
            ValueError: an id is out of range or a destination repeats.
        """
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_blocks, self.num_blocks, "copy_blocks")
        flat = self._flat(self._pool)
        src, dst = src.to(self.device), dst.to(self.device)
        flat.index_copy_(1, dst, flat.index_select(1, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (all layers, K and V).

        Args:
            pairs: (device block id, host block id); host ids distinct.

        Raises:
            ValueError: an id is out of range or a host block repeats.
        """
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
        gathered = self._flat(self._pool).index_select(1, src.to(self.device))
        self._flat(self._host_pool).index_copy_(1, dst, gathered.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back into device blocks (all layers, K and V).

        Args:
            pairs: (host block id, device block id); device ids distinct.

        Raises:
            ValueError: an id is out of range or a device block repeats.
        """
        if not pairs:
            return
        src, dst = self._indices(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
        gathered = self._flat(self._host_pool).index_select(1, src)
        if self.device.type == "cuda":
            gathered = gathered.pin_memory()
        flat = self._flat(self._pool)
        flat.index_copy_(1, dst.to(self.device), gathered.to(self.device, non_blocking=True))

    @property
    def bytes_per_stored_block(self) -> int:
        """Bytes of one block as `read_blocks` gives it (every layer's K and V)."""
        shape = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
        return self.bytes_per_block(*shape, self.dtype)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy whole blocks out of the device pool: the one way a block's bytes leave it.

        Args:
            block_ids: device block ids.

        Returns:
            uint8 [len(block_ids), bytes_per_stored_block] on the CPU, a copy: row i holds
            block ``block_ids[i]``'s K and V of every layer, in pool order (K layer 0 ..
            K layer L-1, V layer 0 .. V layer L-1).

        Raises:
            ValueError: an id is out of range.
        """
        pairs = [(b, i) for i, b in enumerate(block_ids)]
        ids, _ = self._indices(pairs, self.num_blocks, len(pairs), "read_blocks")
        rows = self._flat(self._pool).index_select(1, ids.to(self.device))  # (2L, n, bs*H*D)
        rows = rows.transpose(0, 1).contiguous().cpu()  # (n, 2L, bs*H*D)
        return rows.view(torch.uint8).view(len(block_ids), -1)

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
        rows = data.contiguous().view(self.dtype).view(len(block_ids), 2 * self.num_layers, -1)
        self._flat(self._pool).index_copy_(
            1, ids.to(self.device), rows.transpose(0, 1).to(self.device)
        )

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"num_host_blocks={self.num_host_blocks}, groups={self.groups.num_groups})"
        )
