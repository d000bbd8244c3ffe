"""PagedKVCache: layout, sizing, copy-on-write copies and host swapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.cache import PagedKVCache
from pagedkv.cache.huge_pages import HUGE_PAGE


def _filled(num_host_blocks: int = 0, dtype=torch.float32) -> PagedKVCache:
    kv = PagedKVCache(3, 6, 4, 2, 8, dtype=dtype, num_host_blocks=num_host_blocks)
    for layer in range(3):
        # block b of layer l holds value 100 * l + b (keys) and its negation (values)
        ids = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1) + 100 * layer
        kv.key_caches[layer].copy_(ids.expand(6, 4, 2, 8))
        kv.value_caches[layer].copy_(-ids.expand(6, 4, 2, 8))
    return kv


def _block_value(kv: PagedKVCache, layer: int, block: int) -> float:
    k = kv.key_caches[layer][block]
    assert torch.equal(kv.value_caches[layer][block], -k)
    assert (k == k.flatten()[0]).all(), "a block must be copied whole"
    return float(k.flatten()[0])


def test_layout_and_views() -> None:
    kv = PagedKVCache(2, 5, 16, 4, 32, dtype="bfloat16")
    assert len(kv.key_caches) == len(kv.value_caches) == 2
    for cache in kv.key_caches + kv.value_caches:
        assert cache.shape == (5, 16, 4, 32) and cache.dtype == torch.bfloat16
        assert cache.is_contiguous()
    kv.key_caches[1][3, 2, 1, 0] = 7.0
    assert kv.value_caches[1].abs().sum() == 0 and kv.key_caches[0].abs().sum() == 0
    assert kv.num_bytes == PagedKVCache.bytes_per_block(2, 16, 4, 32, torch.bfloat16) * 5


def _huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_pool_on_huge_pages() -> None:
    """A CPU pool of at least 2 MiB starts at a 2 MiB boundary, zero-filled, on transparent
    huge pages where the kernel offers them for advised memory; small pools are plain."""
    kv = PagedKVCache(2, 64, 16, 8, 128, dtype="bfloat16")  # 8 MiB
    assert kv._pool.data_ptr() % HUGE_PAGE == 0 and kv._pool.is_contiguous()
    assert kv._pool.abs().sum() == 0
    kv.key_caches[1][63, 15, 7, 127] = 3.0  # the last element is inside the mapping
    assert float(kv._pool[0, 1].sum()) == 3.0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _huge_page_kib(kv._pool.data_ptr()) >= HUGE_PAGE // 1024
    small = PagedKVCache(1, 2, 4, 2, 8)
    assert small.num_bytes == 2 * 2 * 4 * 2 * 8 * 4 and small._pool.abs().sum() == 0


def test_sizing() -> None:
    per_block = PagedKVCache.bytes_per_block(32, 16, 8, 128, torch.float16)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2 == 2 * 2**20
    assert PagedKVCache.num_blocks_for_memory(2**30 + 5, 32, 16, 8, 128, torch.float16) == 512
    assert PagedKVCache.num_blocks_for_memory(per_block - 1, 32, 16, 8, 128, "fp16") == 0
    assert PagedKVCache.bytes_per_block(1, 1, 1, 1, "float32") == 8


def test_copy_blocks_all_layers_reads_before_writing() -> None:
    kv = _filled()
    kv.copy_blocks([(1, 4), (4, 5), (2, 1)])  # 4 is both a destination and a source
    for layer in range(3):
        got = [_block_value(kv, layer, b) - 100 * layer for b in range(6)]
        assert got == [0, 2, 2, 3, 1, 4]
    kv.copy_blocks([])


def test_swap_out_and_in_round_trip() -> None:
    kv = _filled(num_host_blocks=3)
    kv.swap_out([(5, 0), (2, 2)])
    kv.key_caches[0].zero_()
    kv.value_caches[0].zero_()
    kv.swap_in([(2, 0), (0, 3)])
    assert [_block_value(kv, 0, b) for b in range(6)] == [2, 0, 0, 5, 0, 0]
    assert [_block_value(kv, 2, b) for b in range(6)] == [202, 201, 202, 205, 204, 205]


@pytest.mark.parametrize(
    "method,pairs,message",
    [
        ("copy_blocks", [(0, 6)], r"destination block ids in \[0, 6\), got 6"),
        ("copy_blocks", [(-1, 2)], r"source block ids in \[0, 6\), got -1"),
        ("copy_blocks", [(0, 2), (1, 2)], "distinct destination"),
        ("swap_out", [(0, 2)], r"destination block ids in \[0, 2\), got 2"),
        ("swap_in", [(2, 0)], r"source block ids in \[0, 2\), got 2"),
    ],
)
def test_bad_pairs_raise(method: str, pairs, message: str) -> None:
    kv = PagedKVCache(1, 6, 2, 1, 4, num_host_blocks=2)
    with pytest.raises(ValueError, match=rf"^{method}: expected .*{message}"):
        getattr(kv, method)(pairs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_blocks=0), "num_blocks: expected an int >= 1"),
        (dict(block_size=2.0), "block_size: expected an int >= 1"),
        (dict(num_host_blocks=-1), "num_host_blocks: expected an int >= 0"),
        (dict(dtype="int4"), "dtype: expected one of"),
        (dict(dtype=torch.int32), "dtype: expected float32, bfloat16, float16 or int8"),
    ],
)
def test_bad_config_raises(kwargs: dict, message: str) -> None:
    args = dict(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PagedKVCache(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pools_pinned_host_and_swap() -> None:
    kv = PagedKVCache(2, 4, 4, 1, 8, device="cuda", num_host_blocks=2)
    assert kv.key_caches[0].is_cuda and kv._host_pool.is_pinned()
    kv.key_caches[1][3].fill_(3.0)
    kv.swap_out([(3, 1)])
    kv.swap_in([(1, 0)])
    kv.copy_blocks([(0, 2)])
    torch.cuda.synchronize()
    assert float(kv.key_caches[1][2].min()) == 3.0


def test_int8_cache_moves_data_and_scales_together() -> None:
    cache = PagedKVCache(2, 6, 4, 3, 8, dtype="int8", num_host_blocks=3)
    assert cache.is_quantized and cache.key_scale_pool is not None
    assert cache.key_scales[1].shape == (6, 4, 3) and cache.key_scales[1].dtype == torch.float16
    assert cache.num_bytes == 6 * PagedKVCache.bytes_per_block(2, 4, 3, 8, "int8")
    assert PagedKVCache.bytes_per_block(2, 4, 3, 8, "int8") == 2 * 2 * 4 * 3 * (8 + 2)
    gen = torch.Generator().manual_seed(0)
    for pool in (cache.key_pool, cache.value_pool):
        pool.copy_(torch.randint(-127, 128, pool.shape, generator=gen, dtype=torch.int8))
    for pool in (cache.key_scale_pool, cache.value_scale_pool):
        assert pool is not None
        pool.copy_(torch.rand(pool.shape, generator=gen).half())

    def block(b: int) -> list[torch.Tensor]:
        pools = [cache.key_pool, cache.value_pool, cache.key_scale_pool, cache.value_scale_pool]
        return [p[:, b].clone() for p in pools if p is not None]

    before = {b: block(b) for b in range(6)}
    cache.copy_blocks([(0, 5)])
    assert all(torch.equal(x, y) for x, y in zip(block(5), before[0], strict=True))
    cache.swap_out([(1, 2)])
    cache.swap_in([(2, 4)])
    assert all(torch.equal(x, y) for x, y in zip(block(4), before[1], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(block(3), before[3], strict=True))
    assert PagedKVCache(1, 2, 4, 3, 8).key_scales == [None]
