"""The manager's prefix lookups of prompts: hits for `allocate`, and the queries before it
(standard library only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.prefix import ROOT_UID, BlockTokens, PrefixIndex


class PrefixLookups:
    """Prompt lookups in `index` (None: no prefix caching, so never a hit).

    Args:
        index: the prefix index, or None.
        pool: the device pool whose evictions change what the index holds.
        block_size: tokens per block.
    """

    def __init__(self, index: PrefixIndex | None, pool: BlockPool, block_size: int) -> None:
        self.index = index
        self.pool = pool
        self.block_size = block_size
        self._num_resets = 0
        # (token list, its length and the index's state, hits): see `hits`.
        self._memo: tuple[Sequence[Any], tuple[int, int, int, int], list[int]] | None = None

    def lookup(
        self, token_ids: Sequence[Any], *, use_prefix_cache: bool = True
    ) -> tuple[list[int], int, Sequence[BlockTokens]]:
        """`PrefixIndex.lookup` of a prompt with the keys of the full blocks after the hits:
        ``([], ROOT_UID, ())`` without an index, no hit without `use_prefix_cache`."""
        if self.index is None:
            return [], ROOT_UID, ()
        # The last token is always computed (its logits are needed): at most n - 1 cached.
        max_blocks = (len(token_ids) - 1) // self.block_size if use_prefix_cache else 0
        return self.index.lookup(token_ids, self.block_size, max_blocks, with_rest=True)

    def hits(self, token_ids: Sequence[Any]) -> list[int]:
        """The cached blocks `allocate(_, token_ids)` would reuse now.

        The last answer is remembered for the same token list (same object and length)
        while the index is unchanged (no entry added or evicted, no reset): a waiting prompt
        is asked about every step. Only these queries use it; `allocate` looks up afresh.
        """
        index = self.index
        if index is None:
            return []
        state = (len(token_ids), len(index), self.pool.num_evictions, self._num_resets)
        memo = self._memo
        if memo is not None and memo[0] is token_ids and memo[1] == state:
            return memo[2]
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = index.match(token_ids, self.block_size, max_blocks)[0]
        self._memo = (token_ids, state, hits)
        return hits

    def forget(self) -> None:
        """The index was cleared: no remembered answer holds."""
        self._num_resets += 1
        self._memo = None
