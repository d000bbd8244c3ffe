"""Blocks whose KV comes from elsewhere (a disk tier) joining the prefix index as cached
blocks, in every KV cache group (standard library only).

A loaded block is indexed only where a lookup can reach it: the anchor group's block i
under the anchor's name of blocks 0 .. i-1 (named by uid, only where it extends the cached
chain, so a block after a gap is left out), another group's block i under the anchor's name
of the prefix through it (known once the anchor's block i is cached or placed)::

    anchor    [ cached ... | placed ... ]            names n_0 .. n_k
    group g   [ -1 | -1 | cached | placed ... ]      block i keyed ((g, n_i), tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.block_tokens import BlockTokens
from pagedkv.memory.content_hash import content_names
from pagedkv.memory.groups import NULL_BLOCK
from pagedkv.memory.lookups import PrefixLookups
from pagedkv.memory.prefix import ChainRoot, PrefixIndex, PrefixName


def cache_loaded(
    anchor: PrefixLookups,
    token_ids: Sequence[Any],
    root: ChainRoot,
    blocks: Sequence[tuple[int, int]],
) -> list[int | None]:
    """Take free blocks for the loaded ``(group, block index)`` pairs of `token_ids`, index
    them as cached (free, evictable, most recently freed) and return them: the caller
    writes their KV before anything else is allocated or computed.

    Args:
        anchor: the anchor group's lookups (its index, pool and naming).
        root: the prompt's chain root (`chain_root` of its salt).
        blocks: full blocks of the prompt before its last token, each group's in
            increasing block order.

    Returns:
        Per pair, the block taking its KV, or None: cached already, unreachable (no name
        for its prefix), or (every pair) the pool has too few free blocks.
    """
    index = anchor.index
    if index is None or not blocks:
        return [None] * len(blocks)
    start = anchor.chain_start(root)
    hits = anchor.lookup(token_ids, start)[0]
    keys = index.keys_of(token_ids, anchor.block_size)
    names: list[PrefixName] = (
        list(content_names(start, keys)) if anchor.hashed else anchor.names(token_ids, hits, start)
    )
    wanted = _wanted(index, anchor, blocks, keys, names, start, len(hits))
    held = [b for b in hits if b != NULL_BLOCK]
    anchor.pool.touch(held)  # held while allocating, so the new blocks cannot evict them
    try:
        block_ids = anchor.pool.allocate(sum(wanted)).tolist()
    except OutOfBlocks:
        block_ids = []
    placed = iter(block_ids)
    out = [next(placed) if want and block_ids else None for want in wanted]
    if block_ids:
        _index(index, anchor, blocks, out, keys, names, start)
    anchor.pool.free(block_ids)  # evicted before the hits: a chain's tail goes first
    anchor.pool.free(held)
    return out


def _wanted(
    index: PrefixIndex,
    anchor: PrefixLookups,
    blocks: Sequence[tuple[int, int]],
    keys: Sequence[BlockTokens],
    names: Sequence[PrefixName],
    start: ChainRoot,
    num_hits: int,
) -> list[bool]:
    """Per pair, whether it takes a block: reachable and not cached already."""
    # By uid the anchor's blocks named after its hits are those that extend its chain.
    num_named = len(names)
    if not anchor.hashed:
        for g, i in blocks:
            num_named += g == anchor.group and i == num_named
    wanted = []
    for g, i in blocks:
        if i >= num_named or i >= len(keys):
            wanted.append(False)
        elif g == anchor.group and not anchor.hashed:
            wanted.append(i >= num_hits)
        elif g == anchor.group:
            wanted.append(index.block_of(names[i - 1] if i else start, keys[i]) is None)
        else:
            wanted.append(i >= len(names) or index.block_of((g, names[i]), keys[i]) is None)
    return wanted


def _index(
    index: PrefixIndex,
    anchor: PrefixLookups,
    blocks: Sequence[tuple[int, int]],
    block_ids: list[int | None],
    keys: Sequence[BlockTokens],
    names: list[PrefixName],
    start: ChainRoot,
) -> None:
    """Key the placed blocks: the anchor's first (naming the prefixes through them), then
    the other groups' under those names."""
    placed = [(g, i, b) for (g, i), b in zip(blocks, block_ids, strict=True) if b is not None]
    own = [(i, b) for g, i, b in placed if g == anchor.group]
    if anchor.hashed:
        parents: list[ChainRoot] = [names[i - 1] if i else start for i, _ in own]
        index.insert_under(parents, [keys[i] for i, _ in own], [b for _, b in own])
    elif own:
        parent = names[-1] if names else start
        index.insert_keys(parent, [keys[i] for i, _ in own], [b for _, b in own], names)
    others = [(g, i, b) for g, i, b in placed if g != anchor.group]
    index.insert_under(
        [(g, names[i]) for g, i, _ in others], [keys[i] for _, i, _ in others],
        [b for _, _, b in others],
    )  # fmt: skip
