"""The manager's prefix lookups of prompts: hits for `allocate`, and the queries before it
(standard library only).

An anchor group of full attention walks its chain from the root (`PrefixIndex.lookup`). A
sliding-window anchor names prefixes by content (`pagedkv.memory.content_hash`): the
lookup computes every block's key from the tokens and searches from the longest candidate
backwards for one whose window's blocks are all cached (`longest_hit`), as the other groups'
windows are searched at the anchor's hit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, cast

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.block_tokens import BlockTokens
from pagedkv.memory.content_hash import chain_start, content_names
from pagedkv.memory.groups import NULL_BLOCK, first_needed_block
from pagedkv.memory.prefix import ChainRoot, PrefixIndex, PrefixName, chain_root


class PrefixLookups:
    """Prompt lookups in `index` (None: no prefix caching, never a hit) over `pool`, the
    device pool whose evictions change what the index holds; `window`: the group's sliding
    window when it is an anchor that names prefixes by content (see the module docstring)."""

    def __init__(
        self,
        index: PrefixIndex | None,
        pool: BlockPool,
        block_size: int,
        group: int = 0,
        window: int | None = None,
    ) -> None:
        self.index = index
        self.group = group  # the KV cache group whose chains it walks
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.hashed = window is not None
        self._num_resets = 0
        # (token list, its length, chain start, its keys, their content names).
        self._names: tuple[Any, ...] | None = None
        # (token list, (its length, resets, evictions), chain root, hits, uid of the last hit,
        # a getter of their entries, the entries then, the list packed).
        self._memo: tuple[Any, ...] | None = None
        self._evictable: tuple[list[int], tuple[int, int, int], int] | None = None

    def lookup(
        self, token_ids: Sequence[Any], root: ChainRoot, use_prefix_cache: bool = True
    ) -> tuple[list[int], ChainRoot, Sequence[BlockTokens]]:
        """`PrefixIndex.lookup` of a prompt from `root` (its `chain_start`) with the keys of
        the full blocks after the hits: ``([], root, ())`` without an index, no hit without
        `use_prefix_cache`. By content, the hits before the window are NULL_BLOCK."""
        if self.index is None:
            return [], root, ()
        # The last token is always computed (its logits are needed): at most n - 1 cached.
        max_blocks = (len(token_ids) - 1) // self.block_size if use_prefix_cache else 0
        if self.hashed:
            keys, names = self._content_names(token_ids, root)
            hits = self._window_blocks(keys, names, root, min(max_blocks, len(names)))
            return hits, names[len(hits) - 1] if hits else root, keys[len(hits) :]
        return self.index.lookup(token_ids, self.block_size, max_blocks, True, root)

    def chain_start(self, root: ChainRoot) -> ChainRoot:
        """The parent of this group's first block key for a prompt of chain root `root`."""
        return chain_start(root, self.group, self.hashed)

    def names(self, token_ids: Sequence[Any], hits: Sequence[int], start: ChainRoot
              ) -> list[PrefixName]:  # fmt: skip
        """The name of the prefix through each of `hits` (the prompt's leading blocks, from
        `start`): their entries' uids, or by content the hashes of the tokens."""
        if self.hashed:
            return list(self._content_names(token_ids, start)[1][: len(hits)])
        assert self.index is not None, "hits imply an index"
        return hit_uids(self.index, hits)

    def _content_names(self, token_ids: Sequence[Any], start: ChainRoot
                       ) -> tuple[Sequence[BlockTokens], list[bytes]]:  # fmt: skip
        """The keys of the prompt's full blocks and the content names of its leading ones,
        remembered for the same token list (object and length) and start."""
        memo = self._names
        if memo is None or memo[0] is not token_ids or memo[1:3] != (len(token_ids), start):
            assert self.index is not None, "only asked with an index"
            keys = self.index.keys_of(token_ids, self.block_size)
            names = content_names(start, keys)
            memo = self._names = (token_ids, len(token_ids), start, keys, names)
        return memo[3], memo[4]

    def _window_blocks(self, keys: Sequence[BlockTokens], names: list[bytes], start: ChainRoot,
                       num: int) -> list[int]:  # fmt: skip
        """By content, the hits of a prompt (its `keys` and `names`) of at most `num` blocks:
        NULL_BLOCK before the window at the longest hit, then its cached blocks."""
        block_of = self.index.block_of  # type: ignore[union-attr]  # hashed: indexed
        found: dict[int, int | None] = {}

        def cached(_: int, i: int) -> int | None:
            if i not in found:
                found[i] = block_of(names[i - 1] if i else start, keys[i])
            return found[i]

        num = longest_hit(num, [(0, self.window)], self.block_size, cached)
        first = first_needed_block(self.window, num * self.block_size, self.block_size)
        return [NULL_BLOCK] * first + cast("list[int]", [found[i] for i in range(first, num)])

    def hits(self, token_ids: Sequence[Any], salt: str | None = None) -> list[int]:
        """The cached blocks `allocate(_, token_ids, salt=salt)` would reuse now.

        The last answer is remembered for the same token list (same object and length) and
        salt, and checked instead of walked again (a waiting prompt is asked about every
        step): its blocks must still hold the entries found, and the block after them must
        still miss. Only these queries use it; `allocate` looks up afresh.
        """
        index = self.index
        if index is None:
            return []
        if self.hashed:
            return self._hashed_hits(token_ids, salt)
        memo, root = self._memo, self.chain_start(chain_root(salt))
        state = (len(token_ids), self._num_resets, self.pool.num_evictions)
        if memo is not None and memo[0] is token_ids and memo[1][0] == state[0]:
            # Another salt's answer names another chain's blocks: walked again, never reused.
            if memo[2] == root and memo[1][1] == state[1]:
                if self._still_holds(token_ids, memo, memo[1][2] != state[2]):
                    self._memo = (token_ids, state, *memo[2:])
                    return memo[3]
            packed = memo[7]  # the same list after its blocks changed: walk, not pack, again
        else:
            packed = index.pack(token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits, uid = index.match(token_ids, self.block_size, max_blocks, packed, root)
        getter = itemgetter(*hits) if hits else None
        entries = getter(index.block_entries) if getter is not None else None
        self._memo = (token_ids, state, root, hits, uid, getter, entries, packed)
        return hits

    def _hashed_hits(self, token_ids: Sequence[Any], salt: str | None) -> list[int]:
        """`hits` by content, remembered until a block is indexed or evicted."""
        index, start = self.index, self.chain_start(chain_root(salt))
        assert index is not None, "only asked with an index"
        state = (len(token_ids), self._num_resets, self.pool.num_evictions, index.next_uid)
        memo = self._memo
        if memo is not None and memo[0] is token_ids and memo[1:3] == (state, start):
            return memo[3]
        hits = self.lookup(token_ids, start)[0]
        self._memo = (token_ids, state, start, hits)
        return hits

    def _still_holds(self, token_ids: Sequence[Any], memo: tuple[Any, ...], evicted: bool) -> bool:
        """Whether the remembered hits are still what a walk of `token_ids` finds: after an
        eviction each must still hold the entry found, and the block after them must miss."""
        index, block_size = self.index, self.block_size
        assert index is not None, "only asked with an index"
        _, _, _, hits, uid, getter, entries, _ = memo
        if evicted and getter is not None and getter(index.block_entries) != entries:
            return False
        num = len(hits)
        if num >= (len(token_ids) - 1) // block_size:
            return True
        tokens = index.block_tokens(token_ids[num * block_size : (num + 1) * block_size])
        return not index.match_keys([tokens], 1, uid)[0]

    def num_evictable(self, hits: list[int], start: int, num: int) -> int:
        """`BlockPool.num_evictable(hits[start:num])`, remembered for the same `hits` list
        while no block was freed or touched (a hit block evicted means new hits, a new list)."""
        state = (start, num, self.pool.num_moves)
        memo = self._evictable
        if memo is not None and memo[0] is hits and memo[1] == state:
            return memo[2]
        count = self.pool.num_evictable(hits[start:num])
        self._evictable = (hits, state, count)
        return count

    def forget(self) -> None:
        """The index was cleared: no remembered answer holds."""
        self._num_resets += 1
        self._memo = self._evictable = self._names = None


def hit_uids(index: PrefixIndex, hits: Sequence[int]) -> list[PrefixName]:
    """The uids of the entries the hit blocks hold (each names the prefix through it)."""
    uids: list[PrefixName] = []
    for block_id in hits:
        entry = index.block_entries[block_id]
        assert entry is not None, "a hit is indexed"
        uids.append(entry[1])
    return uids


def window_hits(
    index: PrefixIndex,
    token_ids: Sequence[Any],
    anchor_hits: list[int],
    names: Sequence[PrefixName],
    start: ChainRoot,
    windows: Sequence[int | None],
    anchor: int,
    block_size: int,
) -> list[list[int]]:
    """Per group, the cached blocks a prompt reuses, given the `anchor` group's hits.

    The hit is the longest prefix of `anchor_hits` at whose end every group still caches
    the blocks its window reaches (another group's block i keyed under ``(group, names[i])``,
    the anchor's name of the prefix through it; a sliding anchor's block i under
    ``names[i - 1]``, `start` for the first); the blocks before a group's window are
    NULL_BLOCK in its list::

        anchor     [ a0 | a1 | a2 | a3 ]        4 hits
        sliding g  [ -1 | -1 | s2 | s3 ]        s2, s3 cached: 4 hits; s3 evicted: at most 3

    Returns:
        One list per group, all of the hit's length.
    """
    found: dict[tuple[int, int], int | None] = {}

    def cached(group: int, i: int) -> int | None:
        if group == anchor and anchor_hits[i] != NULL_BLOCK:
            return anchor_hits[i]
        if (group, i) not in found:
            tokens = index.block_tokens(token_ids[i * block_size : (i + 1) * block_size])
            parent = (group, names[i]) if group != anchor else names[i - 1] if i else start
            found[group, i] = index.block_of(parent, tokens)
        return found[group, i]

    # A full-attention anchor holds every block of its hits: only the others are searched.
    searched = [(g, w) for g, w in enumerate(windows) if g != anchor or w is not None]
    num = longest_hit(len(anchor_hits), searched, block_size, cached)
    out = []
    for g, window in enumerate(windows):
        first = first_needed_block(window, num * block_size, block_size)
        held = [cached(g, i) for i in range(first, num)]
        assert None not in held, "every block the hit's windows reach is cached"
        out.append([NULL_BLOCK] * first + cast("list[int]", held))
    return out


def longest_hit(
    num: int,
    groups: Sequence[tuple[int, int | None]],
    block_size: int,
    cached: Callable[[int, int], object],
    floor: int = 0,
) -> int:
    """The longest hit of at most `num` blocks at whose end each of `groups` (``(group,
    window)``) has every block its window reaches from `floor` on `cached` (not None);
    `floor` if none. Searched from `num` down: a candidate past a missing block would need
    it, so the next one ends before it."""
    while num > floor:
        missing = _last_missing(cached, groups, num, block_size, floor)
        if missing is None:
            return num
        num = missing
    return floor


def _last_missing(
    cached: Callable[[int, int], object],
    groups: Sequence[tuple[int, int | None]],
    num: int,
    block_size: int,
    floor: int,
) -> int | None:
    """The last block from `floor` on that a hit of `num` blocks needs in one of `groups`
    (``(group, window)``) and that is not `cached`, or None."""
    for g, window in groups:
        first = max(floor, first_needed_block(window, num * block_size, block_size))
        for i in range(num - 1, first - 1, -1):
            if cached(g, i) is None:
                return i
    return None
