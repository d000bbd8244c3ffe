"""Content hashes of cached blocks: keys that stay valid across processes.

The prefix index chains block keys by uids that live as long as the process. A block that
outlives it (written to a disk tier) needs a key computed from content alone::

    hash(block i) = sha256(hash(block i - 1) || tokens of block i as int32 bytes)
    hash(block -1) = root_hash(chain root)   (the salt, or none)

so two blocks share a hash only if their whole prefixes and salts are equal (up to a
sha256 collision, which the tier still catches: it stores and compares the tokens and the
parent's hash). Only blocks whose tokens pack as int32 (`PrefixIndex.pack`) get a hash.

The same hashes name the prefixes of a sliding-window anchor group in memory (see
`chain_start`): its block i is keyed under the hash of blocks 0 .. i-1, found from the
tokens alone.

`ContentHashes` follows the index: the hash of every indexed block is computed when the
block is indexed (its parent's hash is known then), and a block the pool evicts is queued
with its hash for the engine to save before the block is written again. With several KV
cache groups the anchor group's block holds the prefix's hash; group g's block for the same
prefix gets `group_hash` of it, its parent being the prefix's hash.

Standard library only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.memory.block_tokens import BlockTokens
from pagedkv.memory.prefix import (
    ROOT_UID,
    BlockKey,
    ChainRoot,
    Entry,
    PrefixIndex,
    PrefixName,
    group_root,
)


def root_hash(root: ChainRoot) -> bytes:
    """The hash a chain's first block chains from: one per salt, one for no salt.

    Args:
        root: ``ROOT_UID`` or a salt (see `pagedkv.memory.prefix.chain_root`).
    """
    if isinstance(root, str):
        return hashlib.sha256(b"pagedkv.salt\0" + root.encode("utf-8", "surrogatepass")).digest()
    assert root == ROOT_UID, f"a chain roots at ROOT_UID or a salt, got {root!r}"
    return hashlib.sha256(b"pagedkv.root").digest()


def group_hash(group: int, prefix_hash: bytes) -> bytes:
    """The hash naming KV cache group `group`'s block of the prefix hashed `prefix_hash`
    (the anchor group's block is named by `prefix_hash` itself)."""
    return hashlib.sha256(b"pagedkv.group\0" + group.to_bytes(4, "little") + prefix_hash).digest()


def chain_start(root: ChainRoot, group: int, hashed: bool) -> ChainRoot:
    """The parent of the key of group `group`'s first block: `root_hash` of `root` in a
    group whose prefixes are named by content (`hashed`), else `group_root`."""
    return root_hash(root) if hashed else group_root(root, group)


def next_name(index: PrefixIndex, parent: ChainRoot, tokens: BlockTokens) -> PrefixName:
    """The content name of the prefix `parent` + `tokens`: their chained hash, or a fresh uid
    (reached by no lookup) when either is not bytes (tokens that do not pack as int32)."""
    if isinstance(parent, bytes) and isinstance(tokens, bytes):
        return hashlib.sha256(parent + tokens).digest()
    return index.fresh_uid()


def content_names(start: ChainRoot, keys: Sequence[BlockTokens]) -> list[bytes]:
    """The content names of the prefixes through each leading block of `keys` (block tokens
    from `PrefixIndex.keys_of`) chained from `start`: up to the first block that does not
    pack as int32 (`next_name` gives it a fresh uid, which no lookup reaches)."""
    names: list[bytes] = []
    parent = start
    for tokens in keys:
        if not isinstance(parent, bytes) or not isinstance(tokens, bytes):
            break
        parent = hashlib.sha256(parent + tokens).digest()
        names.append(parent)
    return names


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
        # ``(group, root)`` starts an anchor chain outside group 0; ``(group, name)`` keys
        # another group's block of the prefix `name` (a uid > ROOT_UID, or a hash).
        if isinstance(parent, tuple) and (isinstance(parent[1], str) or parent[1] == ROOT_UID):
            parent = parent[1]
        if isinstance(parent, tuple):
            prefix_hash = self._hash_of_name(parent[1])
            if prefix_hash is not None:
                self._hashes[uid] = (group_hash(parent[0], prefix_hash), prefix_hash)
            return
        parent_hash = self._hash_of_name(parent)
        if parent_hash is not None:
            self._hashes[uid] = (hashlib.sha256(parent_hash + tokens).digest(), parent_hash)

    def _hash_of_name(self, name: int | str | bytes) -> bytes | None:
        """The content hash of the prefix named `name`: a chain root's, a content name
        itself, an indexed entry's (None: not hashed)."""
        if isinstance(name, bytes):
            return name
        if isinstance(name, str) or name == ROOT_UID:
            return root_hash(name)
        known = self._hashes.get(name)
        return None if known is None else known[0]

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

    def clear(self) -> None:
        """Forget every hash and queued block (the index was cleared: new weights)."""
        self._hashes.clear()
        self._evicted.clear()

    def __len__(self) -> int:
        return len(self._hashes)
