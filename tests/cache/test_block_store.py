"""BlockStore: verified block files that survive restarts, within a byte budget."""

from __future__ import annotations

import glob
import hashlib
import os
import struct

import pytest
import torch

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_store import BlockStore


def block(i: int, size: int = 1000) -> tuple[bytes, bytes, bytes, bytes]:
    """(hash, parent hash, tokens, data) of a made-up block number `i`."""
    content_hash = hashlib.sha256(b"block %d" % i).digest()
    parent = hashlib.sha256(b"parent %d" % i).digest()
    tokens = struct.pack("=4i", i, i + 1, i + 2, i + 3)
    data = bytes((i * 7 + j) % 251 for j in range(size))
    return content_hash, parent, tokens, data


def path_of(store: BlockStore, content_hash: bytes) -> str:
    name = content_hash.hex()
    return os.path.join(store.directory, name[:2], name + ".kvb")


def test_a_written_block_reads_back_after_a_restart(tmp_path) -> None:
    store = BlockStore(str(tmp_path), "ns", 1 << 20, {"model": "m"})
    h, parent, tokens, data = block(1)
    written = store.write(h, parent, tokens, data)
    assert written > len(data) and store.write(h, parent, tokens, data) == 0
    again = BlockStore(str(tmp_path), "ns", 1 << 20)
    assert len(again) == 1 and again.contains(h)
    assert bytes(again.read(h, parent, tokens)) == data
    assert not BlockStore(str(tmp_path), "other", 1 << 20).contains(h)  # namespaces apart


@pytest.mark.parametrize("damage", ["flip", "truncate", "tokens", "parent"])
def test_a_damaged_or_colliding_file_is_a_miss_and_is_deleted(tmp_path, damage: str) -> None:
    store = BlockStore(str(tmp_path), "ns", 1 << 20)
    h, parent, tokens, data = block(2)
    store.write(h, parent, tokens, data)
    path = path_of(store, h)
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
        open(path, "wb").write(raw)
    elif damage == "truncate":
        open(path, "wb").write(raw[:-7])
    elif damage == "tokens":  # same hash, other tokens: a collision
        tokens = struct.pack("=4i", 0, 0, 0, 0)
    else:
        parent = hashlib.sha256(b"elsewhere").digest()
    assert store.read(h, parent, tokens) is None
    assert not os.path.exists(path) and not store.contains(h)
    assert store.num_corrupt == 1


def test_the_least_recently_used_files_go_past_the_capacity(tmp_path) -> None:
    store = BlockStore(str(tmp_path), "ns", 1 << 20)
    size = store.write(*block(0))
    capacity = 3 * size
    store = BlockStore(str(tmp_path), "ns", capacity)
    for i in (1, 2):
        store.write(*block(i))
    h0, p0, t0, _ = block(0)
    assert store.read(h0, p0, t0) is not None  # 0 is now the most recently used
    store.write(*block(3))  # over: down to the low-water mark, so 1 and 2 go
    assert store.num_evictions == 2 and len(store) == 2
    assert store.contains(h0) and store.contains(block(3)[0])
    for gone in (1, 2):
        assert not store.contains(block(gone)[0])
        assert not os.path.exists(path_of(store, block(gone)[0]))
    assert store.num_bytes <= capacity
    smaller = BlockStore(str(tmp_path), "ns", 2 * size)  # a restart with less room
    assert len(smaller) == 2 and smaller.contains(block(3)[0])


def directory_bytes(root) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(str(root), "*", "*", "*.kvb")))


def test_stores_sharing_a_directory_keep_one_budget_and_evict_each_others_files(
    tmp_path,
) -> None:
    size = BlockStore(str(tmp_path / "probe"), "ns", 1 << 20).write(*block(0))
    capacity = 10 * size
    first = BlockStore(str(tmp_path / "tier"), "model-a", capacity)
    second = BlockStore(str(tmp_path / "tier"), "model-b", capacity)
    for i in range(8):  # 8 blocks of the first, the oldest
        first.write(*block(i))
    for i in range(100, 106):  # together past the capacity: the first's oldest go
        second.write(*block(i))
        assert directory_bytes(tmp_path / "tier") <= capacity
    assert second.num_evictions > 0 and first.num_evictions == 0
    assert not os.path.exists(path_of(first, block(0)[0]))
    assert all(os.path.exists(path_of(second, block(i)[0])) for i in range(100, 106))
    h0, p0, t0, _ = block(0)
    assert first.read(h0, p0, t0) is None and not first.contains(h0)  # learnt: a miss
    third = BlockStore(str(tmp_path / "tier"), "model-a", capacity)  # a restart counts anew
    assert len(third) == len(glob.glob(os.path.join(first.directory, "*", "*.kvb")))


def test_a_start_evicts_a_directory_other_processes_filled_past_its_capacity(tmp_path) -> None:
    big = BlockStore(str(tmp_path), "a", 1 << 20)
    size = big.write(*block(0))
    for i in range(1, 6):
        big.write(*block(i))
    small = BlockStore(str(tmp_path), "b", 3 * size)  # a smaller budget for the directory
    assert small.num_evictions >= 3 and directory_bytes(tmp_path) <= 3 * size
    assert os.path.exists(path_of(big, block(5)[0]))  # the newest stay


def test_a_block_another_process_wrote_is_found(tmp_path) -> None:
    first = BlockStore(str(tmp_path), "ns", 1 << 20)
    second = BlockStore(str(tmp_path), "ns", 1 << 20)
    h, parent, tokens, data = block(4)
    second.write(h, parent, tokens, data)
    assert first.contains(h) and not first.contains(block(5)[0])
    assert bytes(first.read(h, parent, tokens)) == data


def test_temporaries_of_dead_processes_are_removed_at_start(tmp_path) -> None:
    store = BlockStore(str(tmp_path), "ns", 1 << 20)
    h = block(6)[0]
    sub = os.path.dirname(path_of(store, h))
    os.makedirs(sub, exist_ok=True)
    dead = os.path.join(sub, f"{h.hex()}.kvb.{2**22 + 12345}.0.tmp")  # no such pid
    live = os.path.join(sub, f"{h.hex()}.kvb.{os.getpid()}.0.tmp")
    for path in (dead, live):
        open(path, "wb").write(b"partial")
    again = BlockStore(str(tmp_path), "ns", 1 << 20)
    assert not os.path.exists(dead) and os.path.exists(live)
    assert len(again) == 0 and not again.contains(h)


def test_an_unusable_directory_raises_oserror(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError):
        BlockStore(str(tmp_path / "file" / "tier"), "ns", 1 << 20)
    with pytest.raises(ValueError, match="capacity"):
        BlockStore(str(tmp_path), "ns", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_blocks_and_write_blocks_move_whole_blocks(dtype: torch.dtype) -> None:
    source = PagedKVCache(3, 6, 4, 2, 8, dtype=dtype)
    source.key_pool.normal_()
    source.value_pool.normal_()
    data = source.read_blocks([4, 1])
    assert data.dtype == torch.uint8 and tuple(data.shape) == (2, source.bytes_per_stored_block)
    target = PagedKVCache(3, 6, 4, 2, 8, dtype=dtype)
    target.write_blocks([0, 5], data)
    for src, dst in ((4, 0), (1, 5)):
        assert torch.equal(target.key_pool[:, dst], source.key_pool[:, src])
        assert torch.equal(target.value_pool[:, dst], source.value_pool[:, src])
    assert not target.key_pool[:, 1:5].any()
    with pytest.raises(ValueError, match="write_blocks"):
        target.write_blocks([0], data)
    with pytest.raises(ValueError, match="read_blocks"):
        source.read_blocks([6])


_RACER = """
import hashlib, struct, sys
from pagedkv.cache.block_store import BlockStore
store = BlockStore(sys.argv[1], "ns", 1 << 30)
for i in range(60):  # both processes write the same blocks at the same time
    h = hashlib.sha256(b"block %d" % i).digest()
    parent = hashlib.sha256(b"parent %d" % i).digest()
    tokens = struct.pack("=4i", i, i + 1, i + 2, i + 3)
    store.write(h, parent, tokens, bytes((i * 7 + j) % 251 for j in range(200_000)))
"""


def test_processes_writing_one_directory_leave_only_whole_blocks(tmp_path) -> None:
    import subprocess
    import sys

    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path)]) for _ in range(2)]
    assert [racer.wait(timeout=300) for racer in racers] == [0, 0]
    store = BlockStore(str(tmp_path), "ns", 1 << 30)
    assert len(store) == 60
    for i in range(60):
        h, parent, tokens, data = block(i, size=200_000)
        assert bytes(store.read(h, parent, tokens)) == data
    assert not list(tmp_path.glob("ns/*/*.tmp"))


_FILLER = """
import hashlib, struct, sys
from pagedkv.cache.block_store import BlockStore
root, namespace, capacity, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = BlockStore(root, namespace, capacity)
for i in range(first, first + 40):  # distinct blocks, both processes at once
    h = hashlib.sha256(b"block %d" % i).digest()
    store.write(h, h, struct.pack("=4i", i, i, i, i), bytes(20_000))
"""


def test_processes_writing_one_directory_keep_its_one_budget(tmp_path) -> None:
    import subprocess
    import sys

    capacity = 30 * 20_200
    fillers = [
        subprocess.Popen(
            [sys.executable, "-c", _FILLER, str(tmp_path), name, str(capacity), str(first)]
        )
        for name, first in (("a", 0), ("b", 1000))
    ]
    assert [filler.wait(timeout=300) for filler in fillers] == [0, 0]
    assert 0 < directory_bytes(tmp_path) <= capacity
    # A file counted by a scan and then by its writer is counted twice, never less.
    assert int((tmp_path / "budget").read_text()) >= directory_bytes(tmp_path)
