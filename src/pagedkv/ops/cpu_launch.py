"""The C++ launcher of the CPU decode kernels (`csrc/cpu_launch.cpp`): build, load, and the
argument blocks it passes to the Numba entry points (`cpu_entry`).

A decode call that reaches its kernel through Python pays ~13 us of tensor checks and
dispatch on a 0.1 ms call (1 x 512 context, after another kernel has swept the caches); the
launcher does the same checks in C++ and calls the kernel by address: 1.16x -> 1.27x of
SDPA at that size (docs/benchmarks.md, run M). It is optional. `load()` compiles it with
torch's extension builder (a C++ compiler and ninja; ~25 s once per torch and Python
version, kept under torch's extension directory) and is called by `pagedkv.ops.warmup`,
i.e. at engine start-up. Until then, where it cannot be built, or with
`PAGEDKV_CPU_LAUNCHER=0`, the Python fast paths (`cpu.try_decode`, `cpu.try_planned`) run
instead, with the same results.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

_SOURCE = Path(__file__).with_name("csrc") / "cpu_launch.cpp"
DISABLE_ENV = "PAGEDKV_CPU_LAUNCHER"
"""Set to 0 to never build or use the launcher."""


class Launcher(NamedTuple):
    """The loaded extension and what its entry points need from this process."""

    module: Any  # .decode, .plan_and_decode (csrc/cpu_launch.cpp)
    gomp_parallel: int  # addresses of the OpenMP runtime's GOMP_parallel
    thread_num: int  # omp_get_thread_num
    team_size: int  # and omp_get_num_threads


class LaunchCaches(NamedTuple):
    """A cache pair's CACHES block and the entry points of its element type."""

    block: torch.Tensor  # int64 [cpu_entry.CACHES_SLOTS]
    decode: int  # cpu_entry.decode_* address
    plan_and_decode: int  # cpu_entry.plan_and_decode_* address
    module: Any  # Launcher.module


_state: dict[str, Launcher | None] = {}
"""The launcher once `load` has run in this process ("launcher": None if it failed)."""


def loaded() -> Launcher | None:
    """The launcher if `load` built or loaded it in this process; never builds."""
    return _state.get("launcher")


def load() -> Launcher | None:
    """Build (once; torch caches the build) and load the launcher; None, with one warning,
    where it cannot be (no compiler or ninja, no OpenMP runtime in the process), or when
    disabled by PAGEDKV_CPU_LAUNCHER=0."""
    if "launcher" in _state:
        return _state["launcher"]
    launcher = None
    if os.environ.get(DISABLE_ENV, "1") != "0":
        try:
            launcher = _build()
        except Exception as error:  # a missing toolchain shows up as many exception types
            warnings.warn(
                f"pagedkv: the C++ launcher of the CPU kernels is unavailable ({error}); "
                "decode calls take the Python path (~10 us more per call)",
                RuntimeWarning,
                stacklevel=2,
            )
    _state["launcher"] = launcher
    return launcher


def _build() -> Launcher:
    process = ctypes.CDLL(None)
    try:  # torch's and Numba's OpenMP runtime, already loaded by torch
        gomp_parallel, thread_num = process.GOMP_parallel, process.omp_get_thread_num
        team_size = process.omp_get_num_threads
    except AttributeError:  # another runtime: the Python path, which Numba threads itself
        raise RuntimeError("no GNU OpenMP runtime (GOMP_parallel) in this process") from None
    from torch.utils import cpp_extension

    from pagedkv.ops import cpu_entry  # compiles the entry points, or loads them from cache

    build_directory = _build_directory()
    module = cpp_extension.load(
        name="pagedkv_cpu_launch",
        sources=[str(_SOURCE)],
        extra_cflags=["-O2"],
        build_directory=str(build_directory),
        verbose=False,
    )
    _check_layout(module, cpu_entry)
    return Launcher(
        module,
        ctypes.cast(gomp_parallel, ctypes.c_void_p).value,
        ctypes.cast(thread_num, ctypes.c_void_p).value,
        ctypes.cast(team_size, ctypes.c_void_p).value,
    )


STALE_LOCK_SECONDS = 600
"""A build lock older than this was left by a build that died (one takes ~30 s): torch's
builder would wait for it forever."""


def _build_directory() -> Path:
    """Where the extension is built: per torch and Python version (the binary depends on
    both), under torch's extension root (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions);
    a stale lock is removed."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    directory = Path(root) / f"pagedkv_cpu_launch-{python}-torch{torch.__version__}"
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
    except FileNotFoundError:
        pass
    return directory


def _check_layout(module: Any, entry: Any) -> None:
    """The C++ side names the blocks' slots as `cpu_entry` does (they are written twice)."""
    wrong = {name: slot for name, slot in module.SLOTS.items() if getattr(entry, name) != slot}
    if wrong or module.CALL_BLOCK < entry.CALL_BLOCK:
        raise RuntimeError(f"csrc/cpu_launch.cpp and cpu_entry disagree on slots {wrong}")


def caches_block(
    launcher: Launcher,
    key_flat: np.ndarray,
    value_flat: np.ndarray,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    max_decode_query: int,
    threads_address: int,
) -> LaunchCaches:
    """The CACHES block of a checked, contiguous cache pair and its flat views."""
    from pagedkv.ops import cpu_entry as e

    _, block_size, num_kv_heads, head_dim = key_cache.shape
    is_float32 = key_cache.dtype == torch.float32
    block = np.zeros(e.CACHES_SLOTS, dtype=np.int64)
    block[e.CACHES_KEY] = key_cache.data_ptr()
    block[e.CACHES_VALUE] = value_cache.data_ptr()
    block[e.CACHES_HEAD_DIM] = head_dim
    block[e.CACHES_NUM_KV_HEADS] = num_kv_heads
    block[e.CACHES_MAX_DECODE_QUERY] = max_decode_query
    block[e.CACHES_ELEMENTS] = key_flat.shape[0]
    block[e.CACHES_BLOCK_SIZE] = block_size
    block[e.CACHES_THREADS] = threads_address
    block[e.CACHES_GOMP_PARALLEL] = launcher.gomp_parallel
    block[e.CACHES_THREAD_NUM] = launcher.thread_num
    block[e.CACHES_TEAM_SIZE] = launcher.team_size
    worker = e.worker_float32 if is_float32 else e.worker_bfloat16
    block[e.CACHES_WORKER] = worker.address
    block[e.CACHES_ELEMENT_SIZE] = key_flat.itemsize
    # The kernels read the caches from these addresses: the views must start there.
    assert key_flat.ctypes.data == block[e.CACHES_KEY]
    assert value_flat.ctypes.data == block[e.CACHES_VALUE]
    return LaunchCaches(
        torch.from_numpy(block),
        (e.decode_float32 if is_float32 else e.decode_bfloat16).address,
        (e.plan_and_decode_float32 if is_float32 else e.plan_and_decode_bfloat16).address,
        launcher.module,
    )


class LaunchRows(NamedTuple):
    """A cache pair's ROWS block for `write_kv` and the entry point of its word type."""

    block: torch.Tensor  # int64 [cpu_entry.ROWS_SLOTS]
    write: int  # cpu_entry.write_words or write_bytes address
    module: Any  # Launcher.module


def rows_block(
    launcher: Launcher,
    key_rows: np.ndarray,
    value_rows: np.ndarray,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> LaunchRows:
    """The ROWS block of a checked, contiguous cache pair and its raw row views (`cpu._bytes`)."""
    from pagedkv.ops import cpu_entry as e

    block = np.zeros(e.ROWS_SLOTS, dtype=np.int64)
    block[e.ROWS_KEY], block[e.ROWS_VALUE] = key_cache.data_ptr(), value_cache.data_ptr()
    block[e.ROWS_NUM_KV_HEADS], block[e.ROWS_HEAD_DIM] = key_cache.shape[2:]
    block[e.ROWS_NUM_SLOTS], block[e.ROWS_WORDS] = key_rows.shape
    # The entry point reads the caches from these addresses: the views must start there.
    assert key_rows.ctypes.data == block[e.ROWS_KEY]
    assert value_rows.ctypes.data == block[e.ROWS_VALUE]
    entry = e.write_words if key_rows.dtype == np.uint64 else e.write_bytes
    return LaunchRows(torch.from_numpy(block), entry.address, launcher.module)


def plan_block(
    num_tokens: int,
    block_tables: np.ndarray,
    items: np.ndarray,
    splits: np.ndarray,
    num_workers: int,
    prefetch: int,
) -> torch.Tensor:
    """The PLAN block of a decode-only plan whose arrays are C-contiguous; they must live as
    long as the block is used."""
    from pagedkv.ops import cpu_entry as e

    block = np.zeros(e.PLAN_SLOTS, dtype=np.int64)
    block[e.PLAN_NUM_TOKENS] = num_tokens
    block[e.PLAN_TABLES] = block_tables.ctypes.data
    block[e.PLAN_NUM_SEQS], block[e.PLAN_MAX_BLOCKS] = block_tables.shape
    block[e.PLAN_ITEMS], block[e.PLAN_NUM_ITEMS] = items.ctypes.data, items.shape[0]
    block[e.PLAN_SPLITS], block[e.PLAN_NUM_SPLITS] = splits.ctypes.data, splits.shape[0]
    block[e.PLAN_NUM_WORKERS], block[e.PLAN_PREFETCH] = num_workers, prefetch
    return torch.from_numpy(block)
