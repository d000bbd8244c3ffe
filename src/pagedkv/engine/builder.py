"""Build an engine's parts from a model directory and `LLM`-style keyword arguments:
load the model and tokenizer, size the KV pool, create the manager and runner."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from pagedkv.engine.runner import ModelRunner
from pagedkv.memory import KVCacheManager
from pagedkv.models import load_model, resolve_dtype
from pagedkv.models.tokenizer import Tokenizer, load_tokenizer

# Without num_blocks or kv_cache_memory the pool takes this share of the memory that is
# free after loading the weights (CPU: MemAvailable; CUDA: mem_get_info).
_CPU_MEMORY_SHARE = 0.3
_GPU_MEMORY_SHARE = 0.8
_DEFAULT_BATCHED_TOKENS = 2048


def build_engine_parts(
    model: str | Path,
    *,
    dtype: str = "auto",
    device: str = "auto",
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_memory: int | str | None = None,
    swap_space: int | str = 0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    preemption_mode: str = "recompute",
    seed: int = 0,
    max_model_len: int | None = None,
    max_preemptions: int = 4,
    attention_backend: str = "auto",
) -> tuple[EngineConfig, ModelRunner, KVCacheManager, Tokenizer | None, dict[str, int]]:
    """Everything `LLMEngine.__init__` takes, built from a model directory.

    Returns:
        (config, runner, kv_manager, tokenizer, {"max_model_len": ...}).

    Raises:
        ValueError: a bad argument, or a model directory that cannot be loaded.
    """
    model_config = ModelConfig.from_hf(model)
    if max_model_len is None:
        max_model_len = model_config.max_position_embeddings
    if max_model_len <= 0:
        raise ValueError(f"max_model_len: expected > 0, got {max_model_len}")
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = resolve_dtype(dtype, model_config)
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_memory=None if kv_cache_memory is None else parse_size(kv_cache_memory),
        swap_space=parse_size(swap_space),
        enable_prefix_caching=enable_prefix_caching,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or _DEFAULT_BATCHED_TOKENS,
        preemption_mode=preemption_mode,  # type: ignore[arg-type]
        max_preemptions=max_preemptions,
    )
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
        enable_prefix_caching=enable_prefix_caching,
        num_host_blocks=host_blocks,
    )
    config = EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=scheduler,
        model_path=str(model),
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(device),
        seed=seed,
    )
    runner = ModelRunner(network, kv_cache, attention_backend=attention_backend)
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
