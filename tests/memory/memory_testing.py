"""Shared helpers for the memory tests: a full-state snapshot and a checked manager."""

from __future__ import annotations

from typing import Any

from pagedkv.memory import KVCacheManager


def snapshot(manager: KVCacheManager) -> dict[str, Any]:
    """Everything observable about `manager`, to compare before and after a failed call."""
    pool, index = manager._pool, manager._index
    seqs = {
        seq_id: (
            [
                (
                    list(g.block_ids),
                    g.num_keyed,
                    g.chain_uid,
                    g.num_dropped,
                    None if g.host_block_ids is None else list(g.host_block_ids),
                )
                for g in s.groups
            ],
            list(s.token_ids),
            s.chain_root,
            s.is_swapped,
        )
        for seq_id, s in manager._seqs.items()
    }
    return {
        "seqs": seqs,
        "free": pool.free_block_ids(),
        "cached": pool.cached_block_ids(),
        "refs": pool.ref_counts(),
        "host_free": manager._host.free_block_ids(),
        "keys": None if index is None else list(index.block_entries),
        "copies": list(manager._appender.copies),
        "stats": manager.stats(),
    }


def tokens(start: int, num: int) -> list[int]:
    """``num`` consecutive token ids from ``start`` (distinct prompts for distinct starts)."""
    return list(range(start, start + num))
