"""Content hashes of cached blocks: keys that stay valid across processes.

The prefix index chains block keys by uids that live as long as the process. A block that
outlives it (written to a disk tier) needs a key computed from content alone::

    hash(block i) = sha256(hash(block i - 1) || tokens of block i as int32 bytes)
    hash(block -1) = root_hash(chain root)   (the salt, or none)

so two blocks share a hash only if their whole prefixes and salts are equal (up to a
sha256 collision, which the tier still catches: it stores and compares the tokens and the
parent's hash). Only blocks whose tokens pack as int32 (`PrefixIndex.pack`) get a hash.

`ContentHashes` follows the index: the hash of every indexed block is computed when the
block is indexed (its parent's hash is known then), and a block the pool evicts is queued
with its hash for the engine to save before the block is written again.

Standard library only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pagedkv.memory.prefix import ROOT_UID, BlockKey, ChainRoot, Entry

HASH_BYTES = 32


def root_hash(root: ChainRoot) -> bytes:
    """The hash a chain's first block chains from: one per salt, one for no salt.

    Args:
        root: ``ROOT_UID`` or a salt (see `pagedkv.memory.prefix.chain_root`).
    """
    if isinstance(root, str):
        return hashlib.sha256(b"pagedkv.salt\0" + root.encode("utf-8", "surrogatepass")).digest()
    assert root == ROOT_UID, f"a chain roots at ROOT_UID or a salt, got {root!r}"
    return hashlib.sha256(b"pagedkv.root").digest()


def chain_hashes(packed: bytes, block_size: int, root: ChainRoot, num_blocks: int) -> list[bytes]:
    """The content hashes of the first `num_blocks` full blocks of a packed prompt.

    Args:
        packed: the prompt's tokens as int32 bytes (`PrefixIndex.pack`).
        block_size: tokens per block.
        root: the chain's root (`chain_root` of the prompt's salt).
        num_blocks: blocks wanted (at most the prompt's full blocks).

    Returns:
        One 32-byte sha256 digest per block, in order.
    """
    width = 4 * block_size
    num = min(num_blocks, len(packed) // width)
    parent = root_hash(root)
    hashes: list[bytes] = []
    for i in range(num):
        parent = hashlib.sha256(parent + packed[i * width : (i + 1) * width]).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block the pool evicted: its KV must be read before the block is written."""

    block_id: int
    content_hash: bytes
    parent_hash: bytes
    tokens: bytes  # the block's tokens as int32 bytes


class ContentHashes:
    """The content hash of every indexed block, and the queue of evicted hashed blocks.

    The prefix index calls `add` for each new entry and `evict` when the pool evicts one;
    the engine reads the queue (`pop_evicted`) before anything writes into the pool.
    Memory: one dict entry (two 32-byte digests) per indexed block.
    """

    __slots__ = ("_hashes", "_evicted", "_block_entries")

    def __init__(self, block_entries: list[Entry | None] | None = None) -> None:
        # The index's entry per block (`PrefixIndex.block_entries`), for `indexed`.
        self._block_entries = block_entries if block_entries is not None else []
        # uid -> (hash, parent's hash) while the uid's entry is indexed.
        self._hashes: dict[int, tuple[bytes, bytes]] = {}
        self._evicted: list[EvictedBlock] = []

    def add(self, uid: int, key: BlockKey) -> None:
        """Hash the new entry `uid` with key ``(parent, tokens)``: not hashed when its tokens
        are not int32 bytes, or its parent's hash is gone (a chain position held by a
        duplicate block whose entry was evicted)."""
        parent, tokens = key
        if not isinstance(tokens, bytes):
            return
        if isinstance(parent, tuple):
            return  # a later KV cache group's chain: the tier keeps one group only
        if isinstance(parent, str) or parent == ROOT_UID:
            parent_hash = root_hash(parent)
        else:
            known = self._hashes.get(parent)
            if known is None:
                return
            parent_hash = known[0]
        self._hashes[uid] = (hashlib.sha256(parent_hash + tokens).digest(), parent_hash)

    def evict(self, entry: Entry) -> None:
        """The pool evicted `entry`'s block: queue it (if hashed) and forget its hash."""
        block_id, uid, key = entry
        hashed = self._hashes.pop(uid, None)
        if hashed is not None:
            assert isinstance(key[1], bytes), "only int32-packed blocks are hashed"
            self._evicted.append(EvictedBlock(block_id, hashed[0], hashed[1], key[1]))

    def pop_evicted(self) -> list[EvictedBlock]:
        """The blocks evicted since the last call, in eviction order."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def indexed(self) -> list[EvictedBlock]:
        """Every hashed block the index holds now (held or cached), as if evicted: what a
        tier saves when the process ends."""
        blocks = []
        for entry in self._block_entries:
            hashed = None if entry is None else self._hashes.get(entry[1])
            if entry is not None and hashed is not None:
                tokens = entry[2][1]
                assert isinstance(tokens, bytes), "only int32-packed blocks are hashed"
                blocks.append(EvictedBlock(entry[0], hashed[0], hashed[1], tokens))
        return blocks

    def hash_of(self, uid: int) -> bytes | None:
        """The content hash of the indexed entry `uid`, or None if not hashed."""
        known = self._hashes.get(uid)
        return None if known is None else known[0]

    def clear(self) -> None:
        """Forget every hash and queued block (the index was cleared: new weights)."""
        self._hashes.clear()
        self._evicted.clear()

    def __len__(self) -> int:
        return len(self._hashes)
