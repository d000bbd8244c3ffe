"""Per-sequence state of the KV-cache manager, the parts its helpers share, and input
validation (standard library only)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.block_tokens import BlockTokens
from pagedkv.memory.content_hash import chain_start
from pagedkv.memory.groups import GroupBlocks
from pagedkv.memory.prefix import ROOT_UID, ChainRoot, PrefixIndex, PrefixName


@dataclass(slots=True, eq=False)
class SeqState:
    """One sequence's state: its blocks in each KV cache group, and its tokens."""

    groups: tuple[GroupBlocks, ...]
    # The tokens, kept only for the prefix index (empty without one): the prompt stays the
    # tuple `allocate` packed its keys from (no second copy) until the first `append`
    # turns it into a list.
    token_ids: list[Any] | tuple[Any, ...]
    num_tokens: int
    is_swapped: bool = False
    # The groups' blocks as the list `KVCacheManager.block_table` hands out, or None once
    # the blocks changed: replaced, never mutated, since a step may still read the old one.
    table: list[int] | None = None
    # The parent of the first block's key: ROOT_UID, or the prompt's salt (`chain_root`).
    chain_root: ChainRoot = ROOT_UID
    # An append that leaves at most this many tokens changes no group's blocks (the least
    # `GroupBlocks.in_place_end`), so a decode step checks one int. Set where a sequence
    # starts or grows; 0 (its next append grows) where its blocks change in any other way
    # or become shared.
    in_place_end: int = 0

    # Per keyed full block, the anchor group's name of the prefix through it (the parent
    # of the other groups' keys of that block, see `pagedkv.memory.groups.anchor_group`).
    prefix_uids: list[PrefixName] = field(default_factory=list)

    def key_full_blocks(
        self,
        index: PrefixIndex | None,
        block_size: int,
        anchor: int,
        keys: Sequence[BlockTokens] | None = None,
    ) -> None:
        """Offer each group's newly full blocks to the prefix index: the `anchor` group's
        as a chain, the others' under its uids. `keys`: their `keys_of`, if known."""
        if index is None:
            return
        groups = self.groups
        start = groups[anchor].num_keyed
        if keys is None:
            keys = index.keys_of(self.token_ids, block_size, start)
        groups[anchor].key_chain(index, keys, self.prefix_uids)
        for g, group in enumerate(groups):
            if g != anchor:
                group.key_under(index, keys, self.prefix_uids, g)

    def set_in_place_end(
        self, num: int, windows: Sequence[int | None], block_size: int, pool: BlockPool
    ) -> None:
        """Set `in_place_end` for the blocks as they are now, holding `num` tokens."""
        end = num + block_size  # more than any group's
        for group, window in zip(self.groups, windows, strict=True):
            group_end = group.in_place_end(num, window, block_size, pool)
            if group_end < end:
                end = group_end
        self.in_place_end = end

    def unkey(self) -> None:
        """Mark no block offered to the prefix index: the next `key_full_blocks` keys them all
        again from the chain's root (after a swap-in or a reset of the index)."""
        self.prefix_uids = []
        for g, group in enumerate(self.groups):
            group.num_keyed, group.chain_uid = 0, chain_start(self.chain_root, g, group.hashed)


@dataclass(frozen=True, slots=True)
class ManagerParts:
    """The parts of a `KVCacheManager` its appender and prompt allocator share."""

    pool: BlockPool  # the device pool
    index: PrefixIndex | None  # None: no prefix caching
    windows: tuple[int | None, ...]  # per KV cache group, its sliding window (None: full)
    block_size: int
    anchor: int  # the group keyed as a chain (`anchor_group`)


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
        if seq.is_swapped:
            raise ValueError(
                f"{op}: expected a resident sequence, got {seq_id!r} swapped out "
                "(only swap_in and free apply)"
            )
        return seq

    def slot_mapping(
        self, seq_id: Hashable, start: int, end: int, block_size: int, group: int
    ) -> list[int]:
        """`KVCacheManager.slot_mapping`: validated, then `slots_of`."""
        seq = self.resident(seq_id, "slot_mapping")
        if not (
            isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= seq.num_tokens
        ):
            raise ValueError(
                f"slot_mapping: expected 0 <= start <= end <= "
                f"{seq.num_tokens}, got start={start!r}, end={end!r}"
            )
        if not 0 <= group < len(seq.groups):
            raise ValueError(f"group: expected 0 <= group < {len(seq.groups)}, got {group!r}")
        return slots_of(table_of(seq), block_size, start, end, len(seq.groups), group)

    def swapped(self, seq_id: Hashable, op: str) -> SeqState:
        """The state of a swapped-out sequence. Raises KeyError if unknown, ValueError (naming
        `op`) if resident."""
        seq = self.state(seq_id)
        if not seq.is_swapped:
            raise ValueError(f"{op}: expected a swapped-out sequence, got {seq_id!r} resident")
        return seq


def table_of(seq: SeqState) -> list[int]:
    """The sequence's block ids as a list, made once per change of its blocks: with G
    groups, entry ``i * G + g`` is group g's block i (one group: its blocks)."""
    table = seq.table
    if table is None:
        groups = seq.groups
        if len(groups) == 1:
            table = groups[0].block_ids.tolist()
        else:
            table = [b for blocks in zip(*(g.block_ids for g in groups), strict=True)
                     for b in blocks]  # fmt: skip
        seq.table = table
    return table


def slots_of(
    block_ids: Sequence[int],
    block_size: int,
    start: int,
    end: int,
    num_groups: int = 1,
    group: int = 0,
) -> list[int]:
    """Slots of positions ``start <= p < end`` in `group`: ``block_ids[p // B * G + group] *
    B + p % B`` for a table of `num_groups` (G) interleaved groups (see `table_of`)."""
    slots: list[int] = []
    # One range per block touched, not one Python step per token.
    for i in range(start // block_size, -(-end // block_size)):
        base = block_ids[i * num_groups + group] * block_size
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
