"""Per-sequence state of the KV-cache manager, and input validation (standard library only)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.prefix import ROOT_UID, ChainRoot, PrefixIndex


@dataclass(slots=True, eq=False)
class SeqState:
    """One sequence's state: its blocks (device or host, ``array('i')``) and its tokens."""

    block_ids: array[int]
    # The tokens, kept only for the prefix index (empty without one): the prompt stays the
    # tuple `allocate` packed its keys from (no second copy) until the first `append`
    # turns it into a list.
    token_ids: list[Any] | tuple[Any, ...]
    num_tokens: int
    # Leading full blocks already offered to the prefix index, and the uid naming the
    # prefix through the last of them (the parent of the next full block's key).
    num_keyed: int
    chain_uid: ChainRoot
    # Host blocks while swapped out (block_ids is then empty), else None.
    host_block_ids: array[int] | None = None
    # `block_ids` as the list `KVCacheManager.block_table` hands out, or None once the
    # blocks changed: replaced, never mutated, since a step may still read the old one.
    table: list[int] | None = None
    # The parent of the first block's key: ROOT_UID, or the prompt's salt (`chain_root`).
    chain_root: ChainRoot = ROOT_UID

    def append_cost(self, num_tokens: int, block_size: int, pool: BlockPool) -> tuple[int, bool]:
        """Free blocks `num_tokens` more tokens take, and whether one of them replaces the
        shared, partially filled last block (copy-on-write)."""
        is_cow = bool(
            num_tokens and self.num_tokens % block_size and pool.is_shared(self.block_ids[-1])
        )
        num = -(-(self.num_tokens + num_tokens) // block_size) - len(self.block_ids)
        return num + is_cow, is_cow

    def grow(
        self, num_tokens: int, block_size: int, pool: BlockPool
    ) -> tuple[int, int] | tuple[()] | None:
        """Take the blocks `num_tokens` more tokens need from `pool`: None, with nothing
        changed, if they are not free; else the copy ``(src, dst)`` to queue when a fresh
        block replaced the shared, partially filled last block, or ()."""
        num_blocks, is_cow = self.append_cost(num_tokens, block_size, pool)
        if num_blocks > pool.num_free_blocks:
            return None
        # A decode step's one block as an int, not an array.
        new = [pool.allocate_one()] if num_blocks == 1 else pool.allocate(num_blocks).tolist()
        table, copy = self.table, ()  # type: list[int] | None, tuple[int, int] | tuple[()]
        if is_cow:
            copy = src, dst = self.block_ids[-1], new.pop(0)
            pool.free([src])  # shared, so it stays held by the others
            self.block_ids[-1] = dst
            table = None
        self.block_ids.extend(new)
        # A new list (a step may still read the old one), extended rather than rebuilt.
        self.table = None if table is None else table + new
        return copy

    def key_full_blocks(self, index: PrefixIndex | None, block_size: int) -> None:
        """Offer the newly full blocks to the prefix index (chained keys)."""
        if index is None:
            return
        start = self.num_keyed
        keys = index.keys_of(self.token_ids, block_size, start)
        self.chain_uid = index.insert_keys(
            self.chain_uid, keys, self.block_ids[start : start + len(keys)]
        )
        self.num_keyed = start + len(keys)

    def unkey(self) -> None:
        """Mark no block offered to the prefix index: the next `key_full_blocks` keys them all
        again from the chain's root (after a swap-in or a reset of the index)."""
        self.num_keyed, self.chain_uid = 0, self.chain_root


class SequenceTable(dict[Hashable, SeqState]):
    """The manager's sequences by id, oldest first, with lookups that name a mistake."""

    def state(self, seq_id: Hashable) -> SeqState:
        """The sequence's state. Raises KeyError if unknown."""
        seq = self.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    def resident(self, seq_id: Hashable, op: str) -> SeqState:
        """The state of a sequence that holds device blocks.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out (naming `op`).
        """
        seq = self.state(seq_id)
        if seq.host_block_ids is not None:
            raise ValueError(
                f"{op}: expected a resident sequence, got {seq_id!r} swapped out "
                "(only swap_in and free apply)"
            )
        return seq

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, block_size: int) -> list[int]:
        """`KVCacheManager.slot_mapping`: validated, then `slots_of`."""
        seq = self.resident(seq_id, "slot_mapping")
        if not (
            isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= seq.num_tokens
        ):
            raise ValueError(
                f"slot_mapping: expected 0 <= start <= end <= "
                f"{seq.num_tokens}, got start={start!r}, end={end!r}"
            )
        return slots_of(seq.block_ids, block_size, start, end)

    def swapped(self, seq_id: Hashable, op: str) -> SeqState:
        """The state of a swapped-out sequence. Raises KeyError if unknown, ValueError (naming
        `op`) if resident."""
        seq = self.state(seq_id)
        if seq.host_block_ids is None:
            raise ValueError(f"{op}: expected a swapped-out sequence, got {seq_id!r} resident")
        return seq


def table_of(seq: SeqState) -> list[int]:
    """The sequence's block ids as a list, made once per change of its blocks."""
    table = seq.table
    if table is None:
        table = seq.table = seq.block_ids.tolist()
    return table


def slots_of(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of positions ``start <= p < end``: ``block_ids[p // B] * B + p % B``."""
    slots: list[int] = []
    # One range per block touched, not one Python step per token.
    for i in range(start // block_size, -(-end // block_size)):
        base = block_ids[i] * block_size
        slots += range(
            base + max(start - i * block_size, 0), base + min(end - i * block_size, block_size)
        )
    return slots


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return `value` if it is an int >= `minimum`.

    Raises:
        ValueError: otherwise, "name: expected an int >= minimum, got value".
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def token_tuple(token_ids: Sequence[Any]) -> tuple[Any, ...]:
    """`token_ids` as a tuple (a tuple is returned as is: it cannot change under us).

    Raises:
        ValueError: `token_ids` is not iterable, or is a str or bytes.
    """
    if not isinstance(token_ids, (str, bytes)):
        try:
            return tuple(token_ids)
        except TypeError:
            pass
    raise ValueError(f"token_ids: expected a sequence of token ids, got {type(token_ids)}")
