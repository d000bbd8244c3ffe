"""Extending resident sequences by tokens (standard library only): blocks on demand, a copy
of a shared partially filled last block, blocks that slid out of a window returned, newly
full blocks keyed. `KVCacheManager.append_many` and `num_blocks_to_append` ask an `Appender`.

A decode step's common append changes no block: a sequence keeps the token count up to which
appends change none of its groups' blocks (`SeqState.in_place_end`), so the step compares
one int per sequence, and only a sequence past it runs `grow`, which loops over the groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from pagedkv.memory.audit import EventCounts
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.groups import first_needed_block
from pagedkv.memory.sequence import (
    ManagerParts,
    SeqState,
    SequenceTable,
    positive_int,
    table_of,
    token_tuple,
)


class Appender:
    """Appends to the sequences of `seqs`, their blocks from ``parts.pool``; copy-on-write
    copies are added to `counts`."""

    def __init__(self, seqs: SequenceTable, parts: ManagerParts, counts: EventCounts) -> None:
        self.seqs, self.counts = seqs, counts
        self.pool, self.index, self.windows = parts.pool, parts.index, parts.windows
        self.block_size, self.anchor = parts.block_size, parts.anchor
        # Copy-on-write copies ``(src, dst)`` queued for `KVCacheManager.pop_copies`.
        self.copies: list[tuple[int, int]] = []

    def append_many(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[Any]]
    ) -> list[list[int]]:
        """`KVCacheManager.append_many`: the block tables of the leading sequences appended
        to, up to the first whose blocks are not free."""
        get, index, block_size = self.seqs.get, self.index, self.block_size
        tables: list[list[int]] = []
        add_table = tables.append
        for seq_id, new in zip(seq_ids, token_ids, strict=True):
            seq = get(seq_id)
            if seq is None or seq.is_swapped:
                seq = self.seqs.resident(seq_id, "append")  # raises
            if type(new) is not list:
                new = list(token_tuple(new))
            num_cur = seq.num_tokens
            num = num_cur + len(new)
            if num > seq.in_place_end and new and not self._grow(seq, len(new)):
                break
            seq.num_tokens = num
            if index is not None:
                tokens = seq.token_ids
                if type(tokens) is not list:  # the prompt, kept as `allocate` got it
                    tokens = seq.token_ids = list(tokens)
                tokens += new
                if num // block_size > num_cur // block_size:
                    seq.key_full_blocks(index, block_size, self.anchor)
            add_table(seq.table or table_of(seq))
        return tables

    def _grow(self, seq: SeqState, num_new: int) -> bool:
        """`grow` with its copies queued; False (nothing changed) if the blocks are not free."""
        copies = grow(seq, self.windows, num_new, self.block_size, self.pool)
        if copies is None:
            return False
        self.copies += copies
        self.counts.num_cow_copies += len(copies)
        return True

    def num_blocks_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        """`KVCacheManager.num_blocks_to_append`."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.is_swapped:
            seq = self.seqs.resident(seq_id, "num_blocks_to_append")  # raises
        if type(num_tokens) is not int or num_tokens < 0:
            positive_int("num_tokens", num_tokens, minimum=0)  # raises
        return sum(append_costs(seq, self.windows, num_tokens, self.block_size, self.pool))

    def pop_copies(self) -> list[tuple[int, int]]:
        """The copies queued since the last call, in order."""
        copies, self.copies = self.copies, []
        return copies


def append_costs(
    seq: SeqState, windows: Sequence[int | None], num_new: int, block_size: int, pool: BlockPool
) -> list[int]:
    """Per group, the free blocks `num_new` more tokens take, less the blocks sliding out of
    its window that no other sequence holds."""
    num_cur = seq.num_tokens
    costs = [group.append_cost(num_cur, num_new, block_size, pool)[0] for group in seq.groups]
    if not num_new:
        return costs
    released = num_released(seq, windows, block_size, pool)
    return [cost - num for cost, num in zip(costs, released, strict=True)]


def num_released(
    seq: SeqState, windows: Sequence[int | None], block_size: int, pool: BlockPool
) -> list[int]:
    """Per group, the blocks the next token's window no longer reaches that no other
    sequence holds (they return to the free pool on the next append)."""
    num_cur = seq.num_tokens
    return [
        0
        if window is None
        else group.num_released(first_needed_block(window, num_cur, block_size), pool)
        for group, window in zip(seq.groups, windows, strict=True)
    ]


def grow(
    seq: SeqState, windows: Sequence[int | None], num_new: int, block_size: int, pool: BlockPool
) -> list[tuple[int, int]] | None:
    """Give each group of `seq` the blocks `num_new` more tokens need, after returning the
    blocks that slid out of its window: None, with nothing changed, if they are not free;
    else the copies ``(src, dst)`` to queue, one per fresh block that replaced a shared,
    partially filled last block. Sets `seq.in_place_end` for the blocks after."""
    num_cur, groups = seq.num_tokens, seq.groups
    costs = [group.append_cost(num_cur, num_new, block_size, pool) for group in groups]
    need = sum([num for num, _ in costs])
    if need > pool.num_free_blocks:  # the blocks sliding out may make up the difference
        need -= sum(num_released(seq, windows, block_size, pool))
        if need > pool.num_free_blocks:
            return None
    # Every group returns its slid-out blocks before any takes one: they may be needed.
    for group, window in zip(groups, windows, strict=True):
        if window is not None:
            group.drop(first_needed_block(window, num_cur, block_size), pool)
    copies = []
    for group, (num_blocks, is_cow) in zip(groups, costs, strict=True):
        if num_blocks:
            copy = group.take(num_blocks, is_cow, pool)
            if copy:
                copies.append(copy)
    seq.set_in_place_end(num_cur + num_new, windows, block_size, pool)
    seq.table = None
    return copies
