"""Build an engine's parts from `EngineArgs`: load the model and tokenizer, size the KV
pool, create the manager and runner."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.cache import PagedKVCache
from pagedkv.config import (
    CPU_KV_MEMORY_CAP,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.prefix_tier import create_rank_tier
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler_output import SchedulerOutput
from pagedkv.engine.workers import (
    Launch,
    TensorParallelRunner,
    Worker,
    first_failure,
    join_group,
    left_key,
    rank_device,
    share_cpu_threads,
    start_workers,
)
from pagedkv.memory.groups import KVGroups, group_layers, sequence_blocks
from pagedkv.models import CausalLM, load_model, resolve_device, resolve_dtype
from pagedkv.models.loader import load_tokenizer
from pagedkv.models.parallel import NO_PARALLEL, TensorParallel, check_split
from pagedkv.models.quantized import block_bytes
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.runtime.tuning import CpuTuning

# Without num_blocks or kv_cache_memory the pool takes this share of the memory that is
# free after loading the weights (CPU: MemAvailable; CUDA: mem_get_info).
_CPU_MEMORY_SHARE = 0.3
_GPU_MEMORY_SHARE = 0.8
logger = logging.getLogger(__name__)


def build_engine_parts(args: EngineArgs) -> tuple[EngineConfig, ModelRunner, Tokenizer | None]:
    """Everything `LLMEngine.__init__` takes, built from the options in `args`.

    With `tensor_parallel_size` N > 1 this process becomes rank 0 of N: it starts the
    workers (`engine.workers`), loads its share and runs it in a `TensorParallelRunner`;
    scheduler and KV manager stay here.

    Raises:
        ValueError: a model directory that cannot be loaded, a model that does not split
            over `tensor_parallel_size` ranks, or a KV pool that holds no block.
        WorkerFailed: a tensor-parallel worker failed while starting.
    """
    model_config = ModelConfig.from_hf(args.model)
    if args.tensor_parallel_size > 1:
        check_split(model_config, args.tensor_parallel_size)  # before any process starts
        tp, workers, device = start_workers(args, serve_rank)
        try:
            config = create_engine_config(args, model_config, device)
            runner = build_rank_runner(args, config, tp, workers)
        except BaseException as exc:
            raise first_failure(workers) or exc from exc
    else:
        config = create_engine_config(args, model_config, resolve_device(args.device))
        runner = build_rank_runner(args, config, NO_PARALLEL)
    return config, runner, load_tokenizer(args.model)


def serve_rank(args: EngineArgs, launch: Launch) -> None:
    """A worker rank: join the group, build this rank's share, run the steps rank 0
    broadcasts until it sends None, then leave.

    The group's connections are closed before the rank records that it left: rank 0 then
    tears its end down with no peer closing underneath it (which can abort a process in
    gloo's threads, `workers._shut_down`)."""
    device = rank_device(args.device, launch)
    tp = join_group(launch, device, [])
    store, rank = tp.store, tp.rank
    _run_steps(args, create_engine_config(args, ModelConfig.from_hf(args.model), device), tp)
    del tp  # with the runner gone, the group's last reference
    dist.destroy_process_group()
    gc.collect()
    store.set(left_key(rank), "1")  # rank 0 may leave now


def _run_steps(args: EngineArgs, config: EngineConfig, tp: TensorParallel) -> None:
    runner = build_rank_runner(args, config, tp)
    tier = create_rank_tier(config, runner.kv_cache, tp)
    while (message := tp.broadcast_object()) is not None:
        if isinstance(message, SchedulerOutput):
            runner.execute(message)
        else:  # rank 0 sends tier messages only with its tier on, as this rank's is
            assert tier is not None, f"a prefix cache tier message without a tier: {message}"
            tier.handle(message)


def create_engine_config(args: EngineArgs, model_config: ModelConfig, device: str) -> EngineConfig:
    """The options in `args` for `model_config` on `device` (the same on every rank)."""
    return EngineConfig(
        model=model_config,
        max_model_len=args.max_model_len or model_config.max_position_embeddings,
        cache=args.create_cache_config(),
        scheduler=args.create_scheduler_config(),
        model_path=args.model,
        dtype=str(resolve_dtype(args.dtype, model_config)).removeprefix("torch."),
        device=device,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def build_rank_runner(
    args: EngineArgs, config: EngineConfig, tp: TensorParallel, workers: list[Worker] | None = None
) -> ModelRunner:
    """Load rank `tp.rank`'s share of the model, allocate its KV pool and wrap both; rank 0
    of a group passes its `workers` (none under torchrun) and gets a `TensorParallelRunner`.

    Every rank calls this at start-up, in step: rank 0 sizes the pool for all of them (a
    block id must mean the same block on every rank) and the others receive its sizes.
    """
    model_config, device = config.model, config.device
    torch_dtype = resolve_dtype(config.dtype)
    num_threads = torch.get_num_threads()
    if tp.size > 1 and not device.startswith("cuda"):
        share_cpu_threads(tp.size)
    network = load_model(
        args.model, dtype=torch_dtype, device=device, tp=tp, quantization=args.quantization
    )
    num_kv_heads = model_config.kv_heads_per_rank(tp.size)
    windows, groups, shape = kv_block_shape(args, config, num_kv_heads)
    cache_dtype = shape[-1]
    sizes = None
    if tp.rank == 0:
        sizes = (
            _num_device_blocks(
                config.cache,
                config.scheduler,
                shape,
                config.max_model_len,
                device,
                tp.size,
                groups.windows,
            ),
            PagedKVCache.num_blocks_for_memory(config.cache.swap_space, *shape),
        )
    num_blocks, num_host_blocks = tp.broadcast_object(sizes)
    kv_cache = PagedKVCache(
        model_config.num_layers,
        num_blocks,
        args.block_size,
        num_kv_heads,
        model_config.head_dim,
        dtype=cache_dtype,
        device=device,
        num_host_blocks=num_host_blocks,
        sliding_windows=windows,
    )
    _log_allocation(network, kv_cache, config.max_model_len)
    network.use_cpu_runtime(
        matvec=args.cpu_matvec,
        fused_decode=args.cpu_fused_decode,
        onednn=args.pack_weights,
        tuning=CpuTuning.load() if network.device.type == "cpu" else None,
        kv_cache_dtype=cache_dtype,
    )
    options: dict[str, Any] = {
        "attention_backend": args.attention_backend,
        "token_buckets": args.token_buckets,
    }
    if workers is None:
        runner = ModelRunner(network, kv_cache, **options)
    else:
        runner = TensorParallelRunner(network, kv_cache, workers, num_threads, **options)
    tp.barrier()  # every rank compiled and allocated: the engine may start
    return runner


def kv_block_shape(
    args: EngineArgs, config: EngineConfig, num_kv_heads: int
) -> tuple[tuple[int | None, ...], KVGroups, tuple[Any, ...]]:
    """The KV pool's layout on one rank holding `num_kv_heads` KV heads.

    Returns:
        ``(windows, groups, shape)``: the layers' sliding windows (empty: one group), their
        KV cache groups, and `PagedKVCache`'s block shape ``(layers_per_group, block_size,
        num_kv_heads, head_dim, dtype)``.
    """
    model_config = config.model
    windows = model_config.sliding_windows if config.cache.kv_cache_groups else ()
    groups = group_layers(windows, model_config.num_layers)
    # Each rank holds (and quantizes) only its own KV heads.
    torch_dtype = resolve_dtype(config.dtype)
    cache_dtype = torch.int8 if args.kv_cache_dtype == "int8" else torch_dtype
    shape = (groups.layers_per_group, args.block_size, num_kv_heads, model_config.head_dim,
             cache_dtype)  # fmt: skip
    return tuple(windows), groups, shape


def kv_capacity(
    windows: tuple[int | None, ...], num_blocks: int, block_size: int, max_model_len: int
) -> dict[str, int]:
    """What a pool of `num_blocks` holds of sequences of `max_model_len` tokens, in `pagedkv
    plan`'s terms: blocks_per_sequence (over the groups of `windows`, see
    `sequence_blocks`) and max_sequences_at_context."""
    per_seq = sum(sequence_blocks(windows, max_model_len, block_size))
    return {"blocks_per_sequence": per_seq, "max_sequences_at_context": num_blocks // per_seq}


def allocation_figures(network: CausalLM, kv_cache: PagedKVCache) -> dict[str, int]:
    """What one rank holds, in `pagedkv plan`'s terms (its figures are per device too).

    Returns:
        weight_bytes, kv_heads_per_gpu, kv_bytes_per_token, kv_bytes_per_block, num_blocks,
        max_kv_tokens, kv_cache_bytes.
    """
    buffers = [t for name, t in network.named_buffers() if "inv_freq" not in name]
    weight_bytes = sum(t.numel() * t.element_size() for t in [*network.parameters(), *buffers])
    weight_bytes += block_bytes(network)  # weights held in GGML blocks
    per_block = kv_cache.num_bytes // kv_cache.num_blocks
    return {
        "weight_bytes": weight_bytes,
        "kv_heads_per_gpu": kv_cache.num_kv_heads,
        # Over every layer, as the plan counts it (a block holds one group's layers).
        "kv_bytes_per_token": per_block // kv_cache.block_size * kv_cache.groups.num_groups,
        "kv_bytes_per_block": per_block,
        "num_blocks": kv_cache.num_blocks,
        "max_kv_tokens": kv_cache.num_blocks * kv_cache.block_size,
        "kv_cache_bytes": kv_cache.num_bytes,
    }


def _log_allocation(network: CausalLM, kv_cache: PagedKVCache, max_len: int) -> None:
    figures = allocation_figures(network, kv_cache)
    tp = network.tp
    logger.info(
        "rank %d of %d on %s: weights %.1f MiB; KV pool %d blocks x %d tokens = %d tokens, "
        "%d KV heads per device, %d bytes per token, %d per block, %.1f MiB",
        tp.rank, tp.size, kv_cache.device, figures["weight_bytes"] / 2**20,
        figures["num_blocks"], kv_cache.block_size, figures["max_kv_tokens"],
        figures["kv_heads_per_gpu"], figures["kv_bytes_per_token"],
        figures["kv_bytes_per_block"], figures["kv_cache_bytes"] / 2**20,
    )  # fmt: skip
    groups = kv_cache.groups
    capacity = kv_capacity(groups.windows, kv_cache.num_blocks, kv_cache.block_size, max_len)
    logger.info(
        "KV cache groups: %d of %d layers (a block covers one group's layers), windows %s; "
        "a sequence of %d tokens holds %d blocks: %d such sequences fit",
        groups.num_groups, groups.layers_per_group, list(groups.windows), max_len,
        capacity["blocks_per_sequence"], capacity["max_sequences_at_context"],
    )  # fmt: skip


def _num_device_blocks(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    shape: tuple[Any, ...],
    max_model_len: int,
    device: str,
    num_ranks: int = 1,
    windows: tuple[int | None, ...] = (None,),
) -> int:
    """num_blocks if given, else what kv_cache_memory holds (per device), else a share of
    free memory (on the CPU at most `CPU_KV_MEMORY_CAP`) capped by what `max_num_seqs`
    sequences of `max_model_len` tokens could ever hold in the KV cache groups of `windows`. On
    the CPU the ranks of one machine split that memory between them."""
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
    if str(device).startswith("cuda"):
        budget = free * _GPU_MEMORY_SHARE
    else:
        budget = min(free * _CPU_MEMORY_SHARE, CPU_KV_MEMORY_CAP) / num_ranks
    cap = scheduler.max_num_seqs * sum(sequence_blocks(windows, max_model_len, cache.block_size))
    blocks = min(PagedKVCache.num_blocks_for_memory(int(budget), *shape), cap)
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
