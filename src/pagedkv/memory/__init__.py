"""The memory layer: block pool, prefix index and KVCacheManager (standard library only).

No torch and no numpy here: the scheduler and the simulator drive this layer without them.
"""

from __future__ import annotations

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.manager import KVCacheManager
from pagedkv.memory.prefix import ROOT_UID, PrefixIndex

__all__ = ["BlockPool", "KVCacheManager", "OutOfBlocks", "PrefixIndex", "ROOT_UID"]
