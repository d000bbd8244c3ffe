"""Build an engine's parts from `EngineArgs`: load the model and tokenizer, size the KV
pool, create the manager and runner."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.runner import ModelRunner
from pagedkv.memory import KVCacheManager
from pagedkv.models import load_model, resolve_dtype
from pagedkv.models.tokenizer import Tokenizer, load_tokenizer

# Without num_blocks or kv_cache_memory the pool takes this share of the memory that is
# free after loading the weights (CPU: MemAvailable; CUDA: mem_get_info).
_CPU_MEMORY_SHARE = 0.3
_GPU_MEMORY_SHARE = 0.8


def build_engine_parts(
    args: EngineArgs,
) -> tuple[EngineConfig, ModelRunner, KVCacheManager, Tokenizer | None, dict[str, int]]:
    """Everything `LLMEngine.__init__` takes, built from the options in `args`.

    Returns:
        (config, runner, kv_manager, tokenizer, {"max_model_len": ...}).

    Raises:
        ValueError: a model directory that cannot be loaded, or a KV pool that holds no block.
    """
    model = args.model
    model_config = ModelConfig.from_hf(model)
    max_model_len = args.max_model_len or model_config.max_position_embeddings
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = resolve_dtype(args.dtype, model_config)
    block_size = args.block_size
    cache = args.create_cache_config()
    scheduler = args.create_scheduler_config()
    network = load_model(model, dtype=torch_dtype, device=device)
    shape = (
        model_config.num_layers,
        block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        torch_dtype,
    )
    pool_blocks = _num_device_blocks(cache, scheduler, shape, max_model_len, device)
    host_blocks = PagedKVCache.num_blocks_for_memory(cache.swap_space, *shape)
    kv_cache = PagedKVCache(
        model_config.num_layers,
        pool_blocks,
        block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype=torch_dtype,
        device=device,
        num_host_blocks=host_blocks,
    )
    kv_manager = KVCacheManager(
        pool_blocks,
        block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        num_host_blocks=host_blocks,
    )
    config = EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=scheduler,
        model_path=str(model),
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(device),
        seed=args.seed,
    )
    runner = ModelRunner(
        network,
        kv_cache,
        attention_backend=args.attention_backend,
        pack_weights=args.pack_weights,
        token_buckets=args.token_buckets,
    )
    return config, runner, kv_manager, load_tokenizer(model), {"max_model_len": max_model_len}


def _num_device_blocks(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    shape: tuple[Any, ...],
    max_model_len: int,
    device: str,
) -> int:
    """num_blocks if given, else what kv_cache_memory holds, else a share of free memory
    capped by what `max_num_seqs` sequences of `max_model_len` tokens could ever use."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory is not None:
        blocks = PagedKVCache.num_blocks_for_memory(cache.kv_cache_memory, *shape)
        if blocks == 0:
            raise ValueError(
                f"kv_cache_memory: expected room for at least one block "
                f"({PagedKVCache.bytes_per_block(*shape)} bytes), "
                f"got {cache.kv_cache_memory} bytes"
            )
        return blocks
    free = _free_memory(device)
    share = _GPU_MEMORY_SHARE if str(device).startswith("cuda") else _CPU_MEMORY_SHARE
    blocks = PagedKVCache.num_blocks_for_memory(int(free * share), *shape)
    cap = scheduler.max_num_seqs * math.ceil(max_model_len / cache.block_size)
    blocks = min(blocks, cap)
    if blocks <= 0:
        raise ValueError(
            f"kv cache: expected free memory for at least one block, got "
            f"{free} bytes free; pass num_blocks or kv_cache_memory"
        )
    return blocks


def _free_memory(device: str) -> int:
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
