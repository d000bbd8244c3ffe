"""Where the CPU kernels' compiled code lives, and the line that says it is made.

Numba caches a function's machine code beside its source file, so two checkouts or two
venvs of the same pagedkv would each compile the kernels again. Instead every kernel file
(`KERNEL_FILES`) calls `use_shared_cache()` before its first `@njit(cache=True)`: that
registers a Numba cache locator which puts their compiled code in

    $PAGEDKV_CACHE_DIR (default: $XDG_CACHE_HOME/pagedkv or ~/.cache/pagedkv)
        /cpu-kernels/<hash of the kernel files + Python + Numba versions>/

so every install whose kernels are byte-identical shares one Numba cache, and the files
import each other normally. A marker per cache dtype (`compiled-float32`, ...) records that
the variants an engine of that dtype runs were built; until it exists, `announce()` prints
one line on stderr. How long the first build takes: docs/benchmarks.md ("First start").

Standard library only (Numba is imported inside `use_shared_cache`): the CLI calls
`announce()` before importing torch or Numba, so the line comes at once; every layer may
import this module (`pagedkv.ops.cpu`'s kernels do).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import sys
import tempfile
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent
KERNEL_FILES = tuple(
    _PACKAGE / name
    for name in (
        "ops/cpu/kernels.py", "ops/cpu/bf16.py", "ops/cpu/spans.py", "ops/cpu/softmax.py",
        "ops/cpu/int8.py", "ops/cpu/int8_spans.py", "ops/cpu/tiles.py",
        "runtime/matvec.py", "runtime/stack.py", "runtime/rows.py", "runtime/phase_products.py",
        "runtime/atomics.py", "runtime/bf16_tiles.py", "runtime/quant/blocks.py",
        "runtime/quant/dots.py", "runtime/quant/vectors.py", "runtime/quant/formats.py",
    )
)  # fmt: skip
"""The files of compiled code and those they import: Numba's cache does not see a callee's
file change, so all of them are in the key."""
_MARKER = "compiled"

_announced = False
_registered = False


def cache_root() -> Path:
    """The user-wide cache directory of pagedkv."""
    root = os.environ.get("PAGEDKV_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"


def kernel_dir() -> Path:
    """The directory of these kernel sources' compiled code (it may not exist yet)."""
    try:
        numba_version = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba_version = "none"
    key = hashlib.sha256()
    for path in KERNEL_FILES:
        key.update(path.read_bytes())
    key.update(f"{sys.version_info[:2]} {numba_version}".encode())
    return cache_root() / "cpu-kernels" / key.hexdigest()[:16]


def use_shared_cache() -> None:
    """Send the Numba cache of every file of `KERNEL_FILES` to `kernel_dir()`; the other
    locators (the source's `__pycache__`, ...) where it cannot be written. Call it before
    the file's functions are decorated; idempotent."""
    global _registered
    if _registered:
        return
    from numba.core import caching

    files = {str(path) for path in KERNEL_FILES}
    directory = str(kernel_dir())

    class SharedLocator(caching.InTreeCacheLocator):
        def __init__(self, py_func: object, py_file: str) -> None:
            super().__init__(py_func, py_file)
            self._cache_path = directory

        def get_source_stamp(self) -> str:
            return _file_hash(self._py_file)  # content, not path or modification time

        @classmethod
        def from_function(cls, py_func: object, py_file: str) -> SharedLocator | None:
            if str(Path(py_file).resolve()) not in files:
                return None
            return super().from_function(py_func, py_file)  # None where not writable

    caching.CacheImpl._locator_classes.insert(0, SharedLocator)
    _registered = True


@functools.cache
def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def announce(dtype: str | None = None) -> None:
    """Say on stderr, once per process, that the kernels compile now: those of `dtype` (a
    cache dtype's name, "float32") when they are not built yet; with no dtype (a command
    starting, before it knows its model's), when none were ever built here."""
    global _announced
    if _announced:
        return
    if next(kernel_dir().glob(f"{_MARKER}-{dtype or '*'}"), None) is not None:
        return  # built before
    _announced = True
    print(
        f"pagedkv: compiling CPU kernels once; cached in {kernel_dir()}",
        file=sys.stderr,
        flush=True,
    )


def mark_compiled(dtype: str) -> None:
    """Record that the kernels of `dtype` are in the cache (called after its warm-up)."""
    try:
        path = kernel_dir() / f"{_MARKER}-{dtype}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass  # a read-only cache: the line is printed again next time, nothing else


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` under a temporary name, then rename it: a concurrent reader (another
    process's first start) sees either no file or the complete one.

    Raises:
        OSError: the directory cannot be made or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise
