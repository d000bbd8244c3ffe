"""KV blocks in host memory keyed by content hash: the prefix cache's tier before the disk.

One buffer of ``capacity // bytes_per_block`` slots, allocated at start (page-locked when
the pool is on a GPU, so that copies to and from the device can run without staging), and
an index ``content hash -> slot`` in least recently used order::

    slab     uint8 [num_slots, bytes_per_block]   a block as `PagedKVCache.read_blocks` gives it
    entries  content_hash -> (slot, parent hash, tokens)   LRU first

A write into a full store evicts the least recently used block: its bytes are copied out
and queued (`pop_evicted`) for the next tier down, the disk, if there is one. A read checks
the parent hash and tokens as the disk tier does (a hash collision is a miss) and returns a
copy, so a slot can be reused while the reader still holds the bytes.

Thread-safe: the engine's reader and writer threads use it at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch


class HostBlock(NamedTuple):
    """A block evicted from host memory, on its way to the next tier."""

    content_hash: bytes
    parent_hash: bytes
    tokens: bytes
    data: torch.Tensor  # uint8 [bytes_per_block], a copy


class _Entry(NamedTuple):
    slot: int
    parent_hash: bytes
    tokens: bytes


class HostStore:
    """Blocks in one host buffer, least recently used evicted (to `pop_evicted`).

    Args:
        capacity: bytes of blocks to hold at most.
        bytes_per_block: bytes of one block (`PagedKVCache.bytes_per_stored_block`).
        pin_memory: page-lock the buffer (a GPU pool; needs CUDA).

    Raises:
        ValueError: `capacity` holds no block.
    """

    def __init__(self, capacity: int, bytes_per_block: int, pin_memory: bool) -> None:
        num_slots = capacity // bytes_per_block
        if num_slots < 1:
            raise ValueError(
                f"prefix_cache_host_size: expected at least one block ({bytes_per_block} "
                f"bytes), got {capacity}"
            )
        self.bytes_per_block = bytes_per_block
        self.capacity = num_slots * bytes_per_block
        self._slab = torch.empty((num_slots, bytes_per_block), dtype=torch.uint8,
                                 pin_memory=pin_memory)  # fmt: skip
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._evicted: list[HostBlock] = []
        self._lock = threading.Lock()
        self.num_hits = self.num_misses = self.num_evictions = 0
        self.bytes_read = self.bytes_written = 0

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def read(self, content_hash: bytes, parent_hash: bytes, tokens: bytes) -> torch.Tensor | None:
        """A copy of the block held for `content_hash` (uint8 [bytes_per_block]), now the
        most recently used; None if none is, or it holds another block (parent or
        tokens differ)."""
        with self._lock:
            entry = self._entries.get(content_hash)
            if entry is None or (entry.parent_hash, entry.tokens) != (parent_hash, tokens):
                return None
            self._entries.move_to_end(content_hash)
            self.num_hits += 1
            self.bytes_read += self.bytes_per_block
            return self._slab[entry.slot].clone()

    def write(self, content_hash: bytes, parent_hash: bytes, tokens: bytes, data: Any) -> int:
        """Hold one block unless it is held; a full store evicts its least recently used.

        Args:
            content_hash, parent_hash: 32-byte digests.
            tokens: the block's tokens as int32 bytes.
            data: its KV, uint8 [bytes_per_block] (a tensor or a numpy array).

        Returns:
            Bytes stored (0: already held).

        Raises:
            ValueError: `data` is not one block's bytes.
        """
        row = torch.as_tensor(data, dtype=torch.uint8).reshape(-1)
        if row.numel() != self.bytes_per_block:
            raise ValueError(
                f"data: expected {self.bytes_per_block} bytes, got {row.numel()}"
            )  # fmt: skip
        with self._lock:
            if content_hash in self._entries:
                return 0
            slot = self._free_slots.pop() if self._free_slots else self._evict_one()
            self._slab[slot].copy_(row)
            self._entries[content_hash] = _Entry(slot, parent_hash, tokens)
            self.bytes_written += self.bytes_per_block
        return self.bytes_per_block

    def _evict_one(self) -> int:
        """Free the least recently used block's slot; its bytes go to `pop_evicted`."""
        self.num_evictions += 1
        return self._pop_oldest()

    def _pop_oldest(self) -> int:
        """Remove the least recently used block, queue a copy of it; its slot."""
        content_hash, entry = self._entries.popitem(last=False)
        data = self._slab[entry.slot].clone()
        self._evicted.append(HostBlock(content_hash, entry.parent_hash, entry.tokens, data))
        return entry.slot

    def pop_evicted(self) -> list[HostBlock]:
        """The blocks evicted since the last call, oldest first."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def pop_all(self) -> list[HostBlock]:
        """Every block held, least recently used first, removed (the process is ending)."""
        with self._lock:
            while self._entries:
                self._free_slots.append(self._pop_oldest())
            evicted, self._evicted = self._evicted, []
        return evicted
