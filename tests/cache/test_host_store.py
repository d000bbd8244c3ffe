"""HostStore and TieredStore: blocks in host memory, least recently used evicted on to the
disk, a chain found across both tiers."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from pagedkv.cache.block_store import BlockStore
from pagedkv.cache.host_store import HostStore
from pagedkv.cache.tiered_store import TieredStore

BYTES = 64


def block(i: int) -> tuple[bytes, bytes, bytes, torch.Tensor]:
    """(hash, parent hash, tokens, data) of a made-up block number `i`."""
    content_hash = hashlib.sha256(b"block %d" % i).digest()
    parent = hashlib.sha256(b"parent %d" % i).digest()
    tokens = struct.pack("=4i", i, i + 1, i + 2, i + 3)
    data = torch.arange(BYTES, dtype=torch.int64).add(7 * i).remainder(251).to(torch.uint8)
    return content_hash, parent, tokens, data


def test_the_least_recently_used_block_is_evicted_with_its_bytes() -> None:
    store = HostStore(3 * BYTES + 10, BYTES, pin_memory=False)
    assert store.capacity == 3 * BYTES
    for i in range(3):
        assert store.write(*block(i)) == BYTES
    assert store.write(*block(0)) == 0  # held already
    h0, p0, t0, d0 = block(0)
    assert torch.equal(store.read(h0, p0, t0), d0)  # 0 is now the most recently used
    store.write(*block(3))
    store.write(*block(4))
    evicted = store.pop_evicted()
    assert [e.content_hash for e in evicted] == [block(1)[0], block(2)[0]]
    for e, i in zip(evicted, (1, 2), strict=True):
        assert (e.parent_hash, e.tokens) == block(i)[1:3] and torch.equal(e.data, block(i)[3])
    assert store.pop_evicted() == [] and len(store) == 3 and store.num_evictions == 2
    assert [store.contains(h) for h in (h0, block(3)[0], block(1)[0], block(4)[0])] == [
        True, True, False, True]  # fmt: skip
    for i in (0, 3, 4):  # the reused slots hold the new blocks
        h, p, t, d = block(i)
        assert torch.equal(store.read(h, p, t), d)
    assert (store.num_hits, store.bytes_read, store.bytes_written) == (4, 4 * BYTES, 5 * BYTES)


def test_a_read_is_a_copy_and_a_collision_is_a_miss() -> None:
    store = HostStore(BYTES, BYTES, pin_memory=False)
    h, p, t, d = block(5)
    store.write(h, p, t, d.numpy())
    copy = store.read(h, p, t)
    copy.zero_()
    assert torch.equal(store.read(h, p, t), d)
    assert store.read(h, hashlib.sha256(b"elsewhere").digest(), t) is None
    assert store.read(h, p, struct.pack("=4i", 0, 0, 0, 0)) is None


def test_bad_sizes_name_the_option() -> None:
    with pytest.raises(ValueError, match="prefix_cache_host_size: expected at least one block"):
        HostStore(BYTES - 1, BYTES, pin_memory=False)
    store = HostStore(BYTES, BYTES, pin_memory=False)
    with pytest.raises(ValueError, match=f"data: expected {BYTES} bytes, got 3"):
        store.write(*block(0)[:3], torch.zeros(3, dtype=torch.uint8))


def test_blocks_the_host_evicts_go_to_the_disk_and_a_chain_spans_both(tmp_path) -> None:
    disk = BlockStore(str(tmp_path), "ns", 1 << 20)
    store = TieredStore(HostStore(2 * BYTES, BYTES, pin_memory=False), disk)
    for i in range(4):
        store.write(*block(i))
    assert len(store.host) == 2 and len(disk) == 2  # 0 and 1 went down
    hashes = [block(i)[0] for i in range(5)]
    assert [store.contains(h) for h in hashes] == [True] * 4 + [False]
    store.count_lookup(hashes[:4])
    assert (store.host.num_misses, disk.num_misses) == (0, 0)  # each gave blocks
    for i in range(4):
        h, p, t, d = block(i)
        assert torch.equal(store.read(h, p, t), d)
    assert (store.host.num_hits, disk.num_hits) == (2, 2)
    store.count_lookup([])
    assert (store.host.num_misses, disk.num_misses) == (1, 1)
    store.count_lookup([block(2)[0]])  # only host memory gave a block
    assert (store.host.num_misses, disk.num_misses) == (1, 2)
    store.spill()  # the process ends: host memory's blocks go to the disk
    assert len(store.host) == 0 and len(BlockStore(str(tmp_path), "ns", 1 << 20)) == 4
    stats = store.stats()
    assert stats["host_evictions"] == 2 and stats["disk_hits"] == 2 and stats["disk_blocks"] == 4


def test_without_a_disk_evicted_blocks_are_dropped() -> None:
    store = TieredStore(HostStore(BYTES, BYTES, pin_memory=False), None)
    for i in range(3):
        store.write(*block(i))
    assert not store.contains(block(0)[0]) and store.contains(block(2)[0])
    assert store.spill() == 0 and "disk_hits" not in store.stats()
    with pytest.raises(ValueError, match="expected a host or a disk tier"):
        TieredStore(None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_store_for_a_gpu_pool_is_page_locked() -> None:
    store = HostStore(2 * BYTES, BYTES, pin_memory=True)
    h, p, t, d = block(1)
    store.write(h, p, t, d.cuda())
    assert store._slab.is_pinned() and torch.equal(store.read(h, p, t), d)
