"""The prefix cache's tiers below the pool: evicted cached blocks kept in host memory and
in files, read back on a miss (`TieredStore`: host memory, then the disk).

Three paths, none of them on the step's critical path but the copy out of evicted blocks:

- save: the pool evicts a cached block when it needs a free one; the manager queues it
  with its content hash (`ContentHashes.pop_evicted`). Before the step's forward pass
  (or any copy into the pool) `save_evicted` copies those blocks' KV out in one gather
  (`PagedKVCache.read_blocks`) and a writer thread stores them (`TieredStore.write`).
- load: `start_load` hashes a new request's full prompt blocks; if the next blocks after
  its in-memory hits are in a tier, a reader thread reads and verifies them while the request
  waits outside the scheduler (other requests keep stepping). `pop_loaded` takes free pool
  blocks for the loaded ones, writes their KV (`PagedKVCache.write_blocks`) and indexes
  them as cached blocks; the request then enters the scheduler and hits them in memory.
- faults: an unusable directory at start, or a failed write (a full disk), is a logged
  warning; the engine keeps serving, without the tier or without its writes.
- tensor parallelism: every rank stores its own heads' share of each block; rank 0 sends
  each decision above to the others (`pagedkv.engine.rank_tier`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_store import BlockStore
from pagedkv.cache.host_store import HostStore
from pagedkv.cache.tiered_store import TieredStore
from pagedkv.config import EngineConfig
from pagedkv.engine.model_identity import model_identity
from pagedkv.engine.rank_tier import (
    DropBlocks,
    FetchBlocks,
    RankTier,
    SaveBlocks,
    TierPeers,
    WriteBlocks,
    write_placed,
)
from pagedkv.engine.request import Request
from pagedkv.engine.tier_io import TierIO
from pagedkv.engine.tier_reads import BlockRead, plan_reads
from pagedkv.memory import KVCacheManager
from pagedkv.memory.content_hash import EvictedBlock
from pagedkv.memory.prefix import PrefixIndex, chain_root
from pagedkv.models.parallel import TensorParallel

logger = logging.getLogger(__name__)

_FORMAT = 1
_IDLE_WAIT_S = 0.05


@dataclass
class _Load:
    """A request waiting for its blocks (`reads`) to be read."""

    request: Request
    reads: list[BlockRead]
    future: Future[list[torch.Tensor]]


class PrefixTier:
    """Saves evicted cached blocks to a `TieredStore` and loads them back for new prompts.

    Args:
        store: host memory and/or block files.
        kv_manager: built with ``hash_contents=True``.
        kv_cache: the pool whose block ids `kv_manager` hands out (rank 0's share).
        peers: the other ranks' tiers under tensor parallelism (None: one rank).
    """

    def __init__(
        self,
        store: TieredStore,
        kv_manager: KVCacheManager,
        kv_cache: PagedKVCache,
        peers: TierPeers | None = None,
    ) -> None:
        self.store = store
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.peers = peers
        assert kv_manager.content_hashes is not None, "the manager must hash contents"
        self._content = kv_manager.content_hashes
        self.block_size = kv_cache.block_size
        self.io = TierIO(store, kv_cache)
        self._loads: dict[str, _Load] = {}
        self._packer = PrefixIndex(1)

    @property
    def is_writable(self) -> bool:
        return self.io.is_writable

    # ---- loads --------------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._loads

    def __len__(self) -> int:
        """Requests waiting for their blocks."""
        return len(self._loads)

    def start_load(self, request: Request) -> bool:
        """Start reading the blocks of `request`'s prompt that follow its in-memory hits.

        Returns:
            True if some are in a tier: the request waits here (see `pop_loaded`); False if
            none is, so it goes to the scheduler now.

        Raises:
            ValueError: `request`'s id is already waiting here.
        """
        if request.request_id in self._loads:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        tokens, salt = request.prompt_token_ids, request.params.cache_salt
        max_blocks = (len(tokens) - 1) // self.block_size
        if request.params.prompt_logprobs is not None or max_blocks <= 0:
            return False  # computes its whole prompt anyway
        first = self.kv_manager.num_cached_tokens(tokens, salt=salt) // self.block_size
        packed = self._packer.pack(tokens)
        if first >= max_blocks or packed is None:
            return False
        windows = self.kv_manager.windows
        reads = plan_reads(windows, self.block_size, packed, chain_root(salt), first, max_blocks,
                           self.store.contains)  # fmt: skip
        self.store.count_lookup([read.content_hash for read in reads])
        if not reads:
            return False
        chain = (
            [read.content_hash for read in reads],
            [read.parent_hash for read in reads],
            [read.tokens for read in reads],
        )
        self._loads[request.request_id] = _Load(request, reads, self.io.read(*chain))
        if self.peers is not None:
            self.peers.send(FetchBlocks(request.request_id, *chain))
        return True

    def pop_loaded(self, wait_one: bool) -> list[Request]:
        """The requests whose reads ended, their blocks now cached in the pool.

        Loaded blocks are cached, not held: placed in a pool too full for their requests'
        prompts, the admission of one request would evict the blocks of the next. So a
        finished read is placed only while the prompts placed so far fit the free blocks
        (each counted whole, as `check_fits` does); on an idle engine the first always is.

        Args:
            wait_one: the engine has nothing else to do: first wait a moment for a read to
                end (without it, its loop would spin).
        """
        if wait_one and self._loads:
            futures = [load.future for load in self._loads.values()]
            wait(futures, _IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        room = self.kv_manager.num_free_blocks
        placed: list[Request] = []
        for load in [load for load in self._loads.values() if load.future.done()]:
            need = -(-(len(load.request.prompt_token_ids) + 1) // self.block_size)
            if need > room and not (wait_one and not placed):
                break  # in arrival order: the others wait behind it
            room -= need
            del self._loads[load.request.request_id]
            self._cache(load)
            placed.append(load.request)
        return placed

    def _cache(self, load: _Load) -> None:
        """Put a finished read's blocks into free pool blocks as cached blocks."""
        try:
            blocks = load.future.result()
        except OSError as exc:
            logger.warning("prefix cache dir: a read failed (%s); computing the prompt", exc)
            blocks = []
        request = load.request
        if self.peers is not None:  # the blocks every rank read whole
            blocks = blocks[: self.peers.agree(request.request_id, len(blocks))]
        if not blocks:  # a file gone or failing verification (counted by the store)
            return
        block_ids = self.kv_manager.cache_blocks(
            request.prompt_token_ids,
            salt=request.params.cache_salt,
            blocks=[(read.group, read.index) for read in load.reads[: len(blocks)]],
        )
        self.save_evicted()  # the blocks just taken may have been evicted: out before written
        if self.peers is not None:
            self.peers.send(WriteBlocks(request.request_id, block_ids))
        write_placed(self.kv_cache, block_ids, blocks)

    def abort(self, request_id: str) -> Request | None:
        """Stop waiting for `request_id`'s blocks; its request, or None if not waiting."""
        load = self._loads.pop(request_id, None)
        if load is not None and self.peers is not None:
            self.peers.send(DropBlocks(request_id))
        return None if load is None else load.request

    # ---- saves --------------------------------------------------------------------------

    def save_evicted(self) -> None:
        """Copy the blocks evicted since the last call out of the pool and queue their
        writes: call it before anything writes into the pool."""
        self._save(self._content.pop_evicted())

    def _save(self, evicted: list[EvictedBlock]) -> None:
        """Copy `evicted` blocks out of every rank's pool and queue their writes."""
        if self.peers is not None and evicted and self.io.is_writable:
            self.peers.send(SaveBlocks(evicted))
        self.io.save(evicted)

    def flush(self) -> None:
        """Wait for this rank's queued writes (tests)."""
        self.io.flush()

    # ---- life cycle and counters --------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Each tier's counters (`TieredStore.stats`) as ``prefix_cache_{tier}_{name}``,
        and the evicted blocks dropped before reaching a tier (rank 0's)."""
        counters = {f"prefix_cache_{name}": value for name, value in self.store.stats().items()}
        return counters | {"prefix_cache_disk_dropped": self.io.num_dropped}

    def stop_writes(self, why: str) -> None:
        """Save no more blocks, on any rank (the pool may hold blocks whose KV was never
        written)."""
        self.io.stop_writes(why)

    def close(self) -> None:
        """Save every cached block still in the pool (host memory's blocks go on to the
        disk), finish the writes on every rank, stop the threads."""
        self._save(self._content.indexed())
        self.io.close()
        if self.peers is not None:
            self.peers.close()


def prefix_tier_applies(config: EngineConfig, kv_cache: PagedKVCache) -> bool:
    """Whether the tiers `config.cache` asks for can run here (a logged warning when they
    cannot: the engine serves without them). The same answer on every rank."""
    cache = config.cache
    if cache.prefix_cache_dir is None and not cache.prefix_cache_host_size:
        return False
    return True


def create_prefix_tier(
    config: EngineConfig, kv_manager: KVCacheManager, kv_cache: PagedKVCache, tp: TensorParallel
) -> PrefixTier | None:
    """Rank 0's tiers that `config.cache` asks for (`prefix_tier_applies` said they can
    run), or None: only a directory was asked for and it is unusable (a logged warning;
    the engine serves without it).

    Raises:
        ValueError: `prefix_cache_host_size` holds no block.
    """
    store = create_tiered_store(config, kv_cache, tp)
    peers = TierPeers(tp) if tp.size > 1 else None
    return None if store is None else PrefixTier(store, kv_manager, kv_cache, peers)


def create_tiered_store(
    config: EngineConfig, kv_cache: PagedKVCache, tp: TensorParallel
) -> TieredStore | None:
    """Rank `tp.rank`'s tiers (None: none usable; see `create_prefix_tier`)."""
    host = create_host_store(config, kv_cache)
    disk = create_block_store(config, kv_cache, rank=tp.rank, tp_size=tp.size)
    return None if host is None and disk is None else TieredStore(host, disk)


def create_rank_tier(
    config: EngineConfig, kv_cache: PagedKVCache, tp: TensorParallel
) -> RankTier | None:
    """A rank > 0's share of the tiers (None: none asked for, or they cannot run here).

    Raises:
        ValueError: `prefix_cache_host_size` holds no block.
    """
    if not prefix_tier_applies(config, kv_cache):
        return None
    store = create_tiered_store(config, kv_cache, tp)
    return RankTier(None if store is None else TierIO(store, kv_cache), kv_cache, tp)


def create_host_store(config: EngineConfig, kv_cache: PagedKVCache) -> HostStore | None:
    """The host-memory tier `prefix_cache_host_size` asks for (None: 0), page-locked for a
    pool on a GPU.

    Raises:
        ValueError: the size holds no block.
    """
    size = config.cache.prefix_cache_host_size
    if not size:
        return None
    on_gpu = kv_cache.device.type == "cuda"
    return HostStore(size, kv_cache.bytes_per_stored_block, pin_memory=on_gpu)


def create_block_store(
    config: EngineConfig, kv_cache: PagedKVCache, *, rank: int, tp_size: int
) -> BlockStore | None:
    """The block files of this rank's namespace under `prefix_cache_dir` (None: no
    directory, or an unusable one, with a logged warning)."""
    directory = config.cache.prefix_cache_dir
    if directory is None:
        return None
    try:
        description = namespace_description(config, kv_cache, rank=rank, tp_size=tp_size)
        text = json.dumps(description, sort_keys=True)
        namespace = hashlib.sha256(text.encode()).hexdigest()[:32]
        size = config.cache.prefix_cache_disk_size
        return BlockStore(directory, namespace, size, description)
    except OSError as exc:
        logger.warning("prefix cache dir %s is unusable (%s); serving without it", directory, exc)
        return None


def namespace_description(
    config: EngineConfig, kv_cache: PagedKVCache, *, rank: int, tp_size: int
) -> dict[str, Any]:
    """What makes two processes' KV blocks interchangeable: the model's files, the KV
    dtype and layout (with KV cache groups, the layers a block holds), the block size and
    the tensor-parallel rank."""
    groups = kv_cache.groups
    layout = {"kv_cache_groups": [list(g) for g in groups.layers]} if groups.num_groups > 1 else {}
    return layout | {
        "format": _FORMAT,
        "model": model_identity(config.model_path),
        "dtype": config.dtype,
        "kv_cache_dtype": str(kv_cache.dtype).removeprefix("torch."),
        "block_size": kv_cache.block_size,
        "num_layers": kv_cache.num_layers,
        "num_kv_heads": kv_cache.num_kv_heads,
        "head_dim": kv_cache.head_dim,
        "tp_rank": rank,
        "tp_size": tp_size,
    }
