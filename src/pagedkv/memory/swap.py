"""Swap to the host pool: the part of `KVCacheManager` that moves a sequence's blocks out
of the device pool and back (standard library only).

A swapped-out sequence keeps its tokens and holds host blocks instead of device blocks;
swapping in takes fresh device blocks and offers its full blocks to the prefix index again.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.prefix import ROOT_UID
from pagedkv.memory.sequence import SeqId, SeqState


class SwapMixin:
    """`swap_out`, `swap_in` and `num_blocks_to_swap_in` for `KVCacheManager`."""

    _pool: BlockPool
    _host: BlockPool
    _num_swapped_out: int
    _num_swapped_in: int
    # Provided by KVCacheManager; declared for type checking only.
    _get: Callable[[SeqId], SeqState]
    _resident: Callable[[SeqId, str], SeqState]
    _key_full_blocks: Callable[[SeqState], None]

    def swap_out(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """Move a sequence to the host pool.

        Returns:
            ``(device_block, host_block)`` pairs, one per block, in table order. The engine
            copies them (after the copies queued before this call, before anything written
            later) since the device blocks are free for reuse from now on.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: already swapped out.
            OutOfBlocks: not enough free host blocks; nothing changed.
        """
        seq = self._resident(seq_id, "swap_out")
        host_block_ids = self._host.allocate(len(seq.block_ids))
        pairs = list(zip(seq.block_ids, host_block_ids, strict=True))
        self._pool.free(seq.block_ids)
        seq.block_ids, seq.host_block_ids, seq.table = array("i"), host_block_ids, None
        seq.is_tail_own = False
        self._num_swapped_out += len(pairs)
        return pairs

    def swap_in(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back to fresh device blocks.

        Its full blocks are offered to the prefix index again.

        Returns:
            ``(host_block, device_block)`` pairs in table order, to copy before the sequence's
            next step.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: not swapped out.
            OutOfBlocks: not enough free device blocks; nothing changed.
        """
        seq = self._get(seq_id)
        if seq.host_block_ids is None:
            raise ValueError(f"swap_in: expected a swapped-out sequence, got {seq_id!r} resident")
        block_ids = self._pool.allocate(len(seq.host_block_ids))
        pairs = list(zip(seq.host_block_ids, block_ids, strict=True))
        self._host.free(seq.host_block_ids)
        seq.block_ids, seq.host_block_ids, seq.table = block_ids, None, None
        seq.num_keyed, seq.chain_uid = 0, ROOT_UID
        self._key_full_blocks(seq)
        self._num_swapped_in += len(pairs)
        return pairs

    def num_blocks_to_swap_in(self, seq_id: SeqId) -> int:
        """Device blocks `swap_in(seq_id)` needs. Raises KeyError if unknown, ValueError if
        resident."""
        seq = self._get(seq_id)
        if seq.host_block_ids is None:
            raise ValueError(f"expected a swapped-out sequence, got {seq_id!r} resident")
        return len(seq.host_block_ids)
