"""Which block files a prompt's disk-tier load reads, in every KV cache group.

A file holds one group's block of one prefix (`pagedkv.memory.content_hash`): the anchor
group's under the prefix's hash ``h_i``, another group g's under ``group_hash(g, h_i)``.
Past the prompt's in-memory hit (``first`` blocks), a load reaches the longest hit ``n`` at
which every group has a file for each block its window reads from ``first`` on (the blocks
before ``first`` that the window reads are in memory: the window at ``first`` read them)::

    blocks          0 ..      first ..        n
    full anchor     [ memory | files ........ ]
    sliding g       [ -1 | memory | files ... ]   from the window at n

No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.memory.content_hash import chain_hashes, group_hash, root_hash
from pagedkv.memory.groups import anchor_group, first_needed_block
from pagedkv.memory.lookups import longest_hit
from pagedkv.memory.prefix import ChainRoot


@dataclass(frozen=True)
class BlockRead:
    """One block file to read: group `group`'s block `index` of the prompt."""

    group: int
    index: int
    content_hash: bytes
    parent_hash: bytes
    tokens: bytes  # the block's tokens as int32 bytes


def plan_reads(
    windows: Sequence[int | None],
    block_size: int,
    packed: bytes,
    root: ChainRoot,
    first: int,
    max_blocks: int,
    contains: Callable[[bytes], bool],
) -> list[BlockRead]:
    """The files a load of the prompt reads (none: nothing past its hit is on disk).

    Args:
        windows: per KV cache group, its sliding window (None: full attention).
        packed: the prompt's tokens as int32 bytes.
        root: its chain root (`chain_root` of its salt).
        first: blocks it hits in memory now.
        max_blocks: blocks it can hit at most (its last token is always computed).
        contains: whether a file for a hash exists.

    Returns:
        Each group's reads in block order, the anchor's first.
    """
    hashes = chain_hashes(packed, block_size, root, max_blocks)
    parents = [root_hash(root), *hashes]
    anchor, width = anchor_group(windows), 4 * block_size

    def read(g: int, i: int) -> BlockRead:
        tokens = packed[i * width : (i + 1) * width]
        if g == anchor:
            return BlockRead(g, i, hashes[i], parents[i], tokens)
        return BlockRead(g, i, group_hash(g, hashes[i]), hashes[i], tokens)

    present: dict[tuple[int, int], bool] = {}

    def on_disk(g: int, i: int) -> bool | None:
        if (g, i) not in present:
            present[g, i] = contains(read(g, i).content_hash)
        return present[g, i] or None

    num = max_blocks
    if windows[anchor] is None:  # a full anchor reads every block: its files bound the hit
        num = next((i for i in range(first, max_blocks) if not on_disk(anchor, i)), max_blocks)
    order = [anchor] + [g for g in range(len(windows)) if g != anchor]
    num = longest_hit(num, [(g, windows[g]) for g in order], block_size, on_disk, first)
    starts = [
        max(first, first_needed_block(windows[g], num * block_size, block_size)) for g in order
    ]
    return [read(g, i) for g, start in zip(order, starts, strict=True) for i in range(start, num)]
