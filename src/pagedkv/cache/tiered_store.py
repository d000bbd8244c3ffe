"""The prefix cache's tiers below the pool as one store: host memory, then disk.

Either tier may be absent (not both). A block the pool evicts goes to host memory; one the
host tier evicts goes on to the disk (or is dropped without one). A lookup walks a prompt's
chain asking the host tier first, then the disk, block by block, so a chain may continue
from one tier into the other; a read copies the block out of whichever holds it.

Counters per tier (its hits, misses, bytes, evictions) live on the tier; a lookup counts a
miss at each tier it asked that gave no block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.cache.block_store import BlockStore
from pagedkv.cache.host_store import HostBlock, HostStore


class TieredStore:
    """`host` before `disk`, with the interface of each: `contains`, `read`, `write`,
    and `count_lookup` for the counters.

    Args:
        host: blocks in host memory, or None.
        disk: block files, or None.

    Raises:
        ValueError: neither tier is given.
    """

    def __init__(self, host: HostStore | None, disk: BlockStore | None) -> None:
        if host is None and disk is None:
            raise ValueError("TieredStore: expected a host or a disk tier, got neither")
        self.host = host
        self.disk = disk

    def __str__(self) -> str:
        parts = [] if self.host is None else [f"host memory ({self.host.capacity} bytes)"]
        return " then ".join(parts + ([] if self.disk is None else [self.disk.directory]))

    def contains(self, content_hash: bytes) -> bool:
        """Whether a tier holds `content_hash` (not yet verified)."""
        in_host = self.host is not None and self.host.contains(content_hash)
        return in_host or (self.disk is not None and self.disk.contains(content_hash))

    def count_lookup(self, found: Sequence[bytes]) -> None:
        """Count a prompt's lookup that found the blocks `found` (hashes; none: a miss in
        every tier): a tier that gave none of them missed (the disk is asked only past
        what host memory holds)."""
        in_host = sum(1 for h in found if self.host is not None and self.host.contains(h))
        if self.host is not None and in_host == 0:
            self.host.num_misses += 1
        if self.disk is not None and in_host == len(found):
            self.disk.num_misses += 1

    def read(self, content_hash: bytes, parent_hash: bytes, tokens: bytes) -> torch.Tensor | None:
        """The block's bytes (uint8 [bytes per block]) from the first tier that holds it,
        verified; None if none does."""
        if self.host is not None:
            data = self.host.read(content_hash, parent_hash, tokens)
            if data is not None:
                return data
        raw = None if self.disk is None else self.disk.read(content_hash, parent_hash, tokens)
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else None

    def write(self, content_hash: bytes, parent_hash: bytes, tokens: bytes, data: Any) -> int:
        """Store one block in the first tier; blocks the host tier evicts go to the disk.

        Returns:
            Bytes stored in either tier.

        Raises:
            OSError: a disk write failed.
        """
        if self.host is None:
            assert self.disk is not None, "a TieredStore has a tier"
            return self.disk.write(content_hash, parent_hash, tokens, data)
        written = self.host.write(content_hash, parent_hash, tokens, data)
        return written + self._to_disk(self.host.pop_evicted())

    def spill(self) -> int:
        """Move every block of host memory to the disk (the process is ending); bytes
        written.

        Raises:
            OSError: a disk write failed.
        """
        return 0 if self.host is None else self._to_disk(self.host.pop_all())

    def _to_disk(self, blocks: list[HostBlock]) -> int:
        if self.disk is None:
            return 0
        return sum(
            self.disk.write(b.content_hash, b.parent_hash, b.tokens, b.data.numpy()) for b in blocks
        )

    def stats(self) -> dict[str, int]:
        """Each tier's counters, as ``{tier}_{name}``: hits and misses (lookups a tier
        answered with no block, files that failed verification) in blocks, bytes read and
        written, evictions, blocks held."""
        out: dict[str, int] = {}
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            failed = tier.num_failed_reads if isinstance(tier, BlockStore) else 0
            out |= {
                f"{name}_hits": tier.num_hits,
                f"{name}_misses": tier.num_misses + failed,
                f"{name}_bytes_read": tier.bytes_read,
                f"{name}_bytes_written": tier.bytes_written,
                f"{name}_evictions": tier.num_evictions,
                f"{name}_blocks": len(tier),
            }
        return out
