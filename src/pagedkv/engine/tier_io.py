"""The prefix cache tiers' copies between one rank's pool and its `TieredStore`, off the
step loop: a writer thread stores the blocks copied out of the pool, a reader thread reads
blocks back. Rank 0's `PrefixTier` and every other rank's `RankTier` use one each.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.cache.tiered_store import TieredStore
from pagedkv.memory.content_hash import EvictedBlock

logger = logging.getLogger(__name__)

# Bytes of evicted blocks copied out and not yet written; past it, evicted blocks are
# dropped rather than let a slow disk grow the process.
_MAX_PENDING_WRITE_BYTES = 256 << 20


class TierIO:
    """Saves blocks of `kv_cache` to `store` and reads them back, on two threads.

    Args:
        store: this rank's tiers.
        kv_cache: this rank's pool.
    """

    def __init__(self, store: TieredStore, kv_cache: PagedKVCache) -> None:
        self.store = store
        self.kv_cache = kv_cache
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tier-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tier-write")
        # Hashes copied out whose blocks are not written yet, and their bytes (the writer
        # thread removes what it wrote, under the lock).
        self._lock = threading.Lock()
        self._writing: set[bytes] = set()
        self._pending_bytes = 0
        self.is_writable = True
        self.num_dropped = 0

    def read(
        self, hashes: list[bytes], parents: list[bytes], blocks: list[bytes]
    ) -> Future[list[torch.Tensor]]:
        """Read the blocks of a chain on the reader thread: the future's result is the
        leading blocks that read back whole and verified (uint8 [bytes per block] each).

        Args:
            hashes, parents: each block's content hash and its parent's.
            blocks: each block's tokens as int32 bytes.
        """
        return self._reader.submit(self._read, hashes, parents, blocks)

    def _read(
        self, hashes: list[bytes], parents: list[bytes], blocks: list[bytes]
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for content_hash, parent_hash, tokens in zip(hashes, parents, blocks, strict=True):
            data = self.store.read(content_hash, parent_hash, tokens)
            if data is None or len(data) != self.kv_cache.bytes_per_stored_block:
                break
            out.append(data)
        return out

    def save(self, evicted: list[EvictedBlock]) -> None:
        """Copy `evicted` blocks out of the pool (one gather) and queue their writes; call
        it before anything writes into those blocks."""
        if not self.is_writable:
            return
        with self._lock:
            evicted = [e for e in evicted if e.content_hash not in self._writing]
            room = _MAX_PENDING_WRITE_BYTES - self._pending_bytes
        evicted = [e for e in evicted if not self.store.contains(e.content_hash)]
        room = max(0, room // self.kv_cache.bytes_per_stored_block)
        self.num_dropped += max(0, len(evicted) - room)
        evicted = evicted[:room]
        if not evicted:
            return
        data = self.kv_cache.read_blocks([e.block_id for e in evicted]).numpy()
        with self._lock:
            self._writing.update(e.content_hash for e in evicted)
            self._pending_bytes += data.nbytes
        self._writer.submit(self._write, evicted, data)

    def _write(self, evicted: list[EvictedBlock], data: Any) -> None:
        """The writer thread: one block at a time; the first failure turns writes off."""
        try:
            for block, row in zip(evicted, data, strict=True):
                if self.is_writable:
                    self.store.write(block.content_hash, block.parent_hash, block.tokens, row)
        except OSError as exc:
            self._write_failed(exc)
        finally:
            with self._lock:
                self._writing.difference_update(block.content_hash for block in evicted)
                self._pending_bytes -= data.nbytes

    def _write_failed(self, exc: OSError) -> None:
        self.is_writable = False
        logger.warning(
            "prefix cache dir %s: writing a block failed (%s); evicted blocks are no "
            "longer saved", self.store, exc,
        )  # fmt: skip

    def _spill(self) -> None:
        """The writer thread at close: host memory's blocks to the disk."""
        try:
            if self.is_writable:
                self.store.spill()
        except OSError as exc:
            self._write_failed(exc)

    def flush(self) -> None:
        """Wait for the queued writes (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def stop_writes(self, why: str) -> None:
        """Save no more blocks (the pool may hold blocks whose KV was never written)."""
        if self.is_writable:
            logger.warning("prefix cache dir %s: no longer saving blocks: %s", self.store, why)
        self.is_writable = False

    def close(self) -> None:
        """Move host memory's blocks to the disk, finish the writes, stop the threads."""
        self._writer.submit(self._spill)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
