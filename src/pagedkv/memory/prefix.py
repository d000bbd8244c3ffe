"""Prefix index: full blocks findable by a chained key, verified on every hit.

A block's key is ``(parent_uid, tokens)``: the uid of the entry for the block before it
(``ROOT_UID`` for a sequence's first block) and the tuple of its ``block_size`` tokens. Every
entry gets a fresh uid that is never reused, so a key names one whole prefix: block ``i``
matches only if blocks ``0 .. i-1`` matched the same entries, and an entry left behind by an
evicted parent can never be reached again.

The key is the dict key itself, so a lookup compares the stored tokens and parent uid with the
prompt's (Python's dict checks equality after the hash matches): two prompts whose keys hash
alike can never share a block. The hash is only an index.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

# The uid a sequence's first block chains from; entries get uids 1, 2, 3, ...
ROOT_UID = 0

BlockKey = tuple[int, tuple[Any, ...]]


def iter_full_blocks(
    token_ids: Sequence[Any], block_size: int, start: int = 0, stop: int | None = None
) -> Iterator[tuple[Any, ...]]:
    """Yield the token tuples of full blocks ``start <= i < stop`` (stop: all full blocks).

    Args:
        token_ids: the sequence's tokens.
        block_size: tokens per block.
        start: first block index.
        stop: one past the last block index; None for every full block.

    Returns:
        An iterator of tuples of exactly ``block_size`` tokens (a partial last block is skipped).
    """
    num_full = len(token_ids) // block_size
    stop = num_full if stop is None else min(stop, num_full)
    if stop <= start:
        return iter(())
    # zip over one iterator taken block_size times cuts the list into tuples in C.
    tokens = iter(token_ids[start * block_size : stop * block_size])
    return zip(*[tokens] * block_size, strict=False)


class PrefixIndex:
    """Map chained block keys to the blocks that hold them.

    Invariants (checked by `check`): each entry's block points back at the entry's key
    (``block_keys[block_id] == key``), at most one entry per block, and uids are unique.
    Duplicates (a second block with the same prefix, e.g. two sequences that generated the
    same text) are not indexed; they share the first entry's uid as their chain position.
    """

    __slots__ = ("_entries", "block_keys", "_next_uid")

    def __init__(self, num_blocks: int) -> None:
        # key -> (block_id, uid); one Python tuple per cached block (the index, not the pool).
        self._entries: dict[BlockKey, tuple[int, int]] = {}
        # block_id -> its key while indexed, else None: 8 bytes per block.
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self._next_uid = ROOT_UID + 1

    def __len__(self) -> int:
        return len(self._entries)

    def match(
        self, token_ids: Sequence[Any], block_size: int, max_blocks: int
    ) -> tuple[list[int], int]:
        """Find the cached blocks holding the leading full blocks of `token_ids`.

        Side-effect free. Block ``i`` matches only if blocks ``0 .. i-1`` matched.

        Args:
            token_ids: the prompt.
            block_size: tokens per block.
            max_blocks: look at most this many leading blocks.

        Returns:
            ``(block_ids, uid)``: the matching blocks in order, and the uid of the last match
            (``ROOT_UID`` when nothing matched).
        """
        get = self._entries.get
        block_ids: list[int] = []
        append = block_ids.append
        uid = ROOT_UID
        for tokens in iter_full_blocks(token_ids, block_size, 0, max_blocks):
            entry = get((uid, tokens))
            if entry is None:
                break
            block_id, uid = entry
            append(block_id)
        return block_ids, uid

    def insert(self, parent_uid: int, tokens: tuple[Any, ...], block_id: int) -> int:
        """Index `block_id` as holding `tokens` after the prefix `parent_uid`.

        Args:
            parent_uid: the chain position of the block before (``ROOT_UID`` for the first).
            tokens: the block's ``block_size`` tokens.
            block_id: a held block whose KV is (or is being) computed for exactly this prefix.

        Returns:
            The uid naming this prefix: a fresh one, or the existing entry's uid if another
            block already holds the same prefix (then `block_id` stays unindexed).
        """
        assert self.block_keys[block_id] is None, f"block {block_id} is indexed already"
        key = (parent_uid, tokens)
        entry = self._entries.get(key)
        if entry is not None:
            return entry[1]
        uid = self._next_uid
        self._next_uid = uid + 1
        self._entries[key] = (block_id, uid)
        self.block_keys[block_id] = key
        return uid

    def remove(self, block_id: int) -> None:
        """Forget the entry held by `block_id` (eviction); its children become unreachable."""
        key = self.block_keys[block_id]
        assert key is not None, f"block {block_id} is not indexed"
        del self._entries[key]
        self.block_keys[block_id] = None

    def uid_of(self, block_id: int) -> int | None:
        """The uid of the entry `block_id` holds, or None if it is not indexed."""
        key = self.block_keys[block_id]
        return None if key is None else self._entries[key][1]

    def clear(self) -> None:
        """Forget every entry (uids keep counting up, so old chains stay unreachable)."""
        for block_id, _ in self._entries.values():
            self.block_keys[block_id] = None
        self._entries.clear()

    def check(self) -> None:
        """Assert the index's own invariants.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        uids = set()
        for key, (block_id, uid) in self._entries.items():
            assert self.block_keys[block_id] == key, (
                f"prefix index: key of block {block_id} does not point back at its entry"
            )
            assert uid not in uids, f"prefix index: uid {uid} is used twice"
            assert ROOT_UID <= key[0] < uid, (
                f"prefix index: block {block_id} chains from uid {key[0]}, not an older entry"
            )
            uids.add(uid)
        num_keyed = sum(key is not None for key in self.block_keys)
        assert num_keyed == len(self._entries), (
            f"prefix index: {num_keyed} blocks carry a key but {len(self._entries)} are indexed"
        )
