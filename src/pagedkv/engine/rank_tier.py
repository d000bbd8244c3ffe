"""The prefix cache's tiers under tensor parallelism: each rank saves and loads its own KV
heads' share of every block, in its own namespace (`namespace_description`: the rank and
the group size), so groups of other sizes never share files.

Rank 0's `PrefixTier` makes every decision (which blocks leave the pool, which prompts read
which blocks, which free pool blocks receive them) and sends each one to the other ranks
over the channel the steps take, in the order it makes them, so a rank copies a block out
of its pool before any later step writes into it::

    rank 0 (PrefixTier)                         rank r (RankTier)
    save_evicted  ── SaveBlocks(evicted) ──────► copy the same block ids out, store them
    start_load    ── FetchBlocks(chain) ───────► read the chain on its reader thread
    _cache        ── PlaceBlocks ──────────────► wait for its read
                  ◄── all-reduce: min over ranks of the blocks read whole ──►
                  cache that many (block ids)
                  ── WriteBlocks(block ids) ───► write them into the same pool blocks
    abort         ── DropBlocks ───────────────► forget the read
    close         ── CloseTier ────────────────► finish the writes; then a barrier

A rank whose file is missing or corrupt lowers the minimum, so every rank places the same
blocks: a block is cached on all ranks or on none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.cache import PagedKVCache
from pagedkv.engine.tier_io import TierIO
from pagedkv.memory.content_hash import EvictedBlock
from pagedkv.models.parallel import TensorParallel


@dataclass(frozen=True)
class SaveBlocks:
    evicted: list[EvictedBlock]


@dataclass(frozen=True)
class FetchBlocks:
    request_id: str
    hashes: list[bytes]
    parents: list[bytes]
    blocks: list[bytes]  # each block's tokens as int32 bytes


@dataclass(frozen=True)
class PlaceBlocks:
    request_id: str


@dataclass(frozen=True)
class WriteBlocks:
    request_id: str
    block_ids: list[int | None]  # per block read, its pool block (None: cached meanwhile)


@dataclass(frozen=True)
class DropBlocks:
    request_id: str


@dataclass(frozen=True)
class CloseTier:
    pass


TierMessage = SaveBlocks | FetchBlocks | PlaceBlocks | WriteBlocks | DropBlocks | CloseTier


def write_placed(
    kv_cache: PagedKVCache, block_ids: list[int | None], rows: list[torch.Tensor]
) -> None:
    """Write each read block's bytes `rows[i]` into pool block `block_ids[i]` (None: not
    placed, the pool had it cached meanwhile)."""
    placed = [(b, row) for b, row in zip(block_ids, rows, strict=True) if b is not None]
    if placed:
        kv_cache.write_blocks([b for b, _ in placed], torch.stack([row for _, row in placed]))


def min_over_ranks(tp: TensorParallel, value: int) -> int:
    """The smallest of every rank's `value` (a collective: every rank calls it)."""
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(box.item())


class TierPeers:
    """Rank 0's line to the other ranks' `RankTier`s."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def send(self, message: TierMessage) -> None:
        self.tp.broadcast_object(message)

    def agree(self, request_id: str, num_read: int) -> int:
        """How many leading blocks of `request_id`'s read every rank has whole."""
        self.send(PlaceBlocks(request_id))
        return min_over_ranks(self.tp, num_read)

    def close(self) -> None:
        """Every rank's writes finished (returns once they have)."""
        self.send(CloseTier())
        self.tp.barrier()


class RankTier:
    """A rank > 0's tiers, doing what rank 0 sends (see the module's diagram).

    Args:
        io: this rank's store and threads; None if its store is unusable (a logged
            warning): it then reads nothing, which makes every load a miss on all ranks.
        kv_cache: this rank's pool.
        tp: the group.
    """

    def __init__(self, io: TierIO | None, kv_cache: PagedKVCache, tp: TensorParallel) -> None:
        self.io = io
        self.kv_cache = kv_cache
        self.tp = tp
        self._reads: dict[str, Any] = {}  # request id -> future of its blocks
        self._placing: dict[str, list[torch.Tensor]] = {}

    def handle(self, message: TierMessage) -> None:
        """Do what rank 0 sent."""
        match message:
            case SaveBlocks(evicted):
                if self.io is not None:
                    self.io.save(evicted)
            case FetchBlocks(request_id, hashes, parents, blocks):
                if self.io is not None:
                    self._reads[request_id] = self.io.read(hashes, parents, blocks)
            case PlaceBlocks(request_id):
                self._place(request_id)
            case WriteBlocks(request_id, block_ids):
                write_placed(self.kv_cache, block_ids, self._placing.pop(request_id))
            case DropBlocks(request_id):
                self._reads.pop(request_id, None)
            case CloseTier():
                if self.io is not None:
                    self.io.close()
                self.tp.barrier()

    def _place(self, request_id: str) -> None:
        """Agree with the other ranks on how many blocks of the read to place."""
        future = self._reads.pop(request_id, None)
        try:
            rows = [] if future is None else future.result()
        except OSError:
            rows = []
        num = min_over_ranks(self.tp, len(rows))
        if num:
            self._placing[request_id] = rows[:num]
