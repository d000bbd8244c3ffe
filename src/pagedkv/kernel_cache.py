"""Where the CPU kernels' compiled code lives, and the line that says it is made.

Numba caches a function's machine code next to its source file, keyed by that file's path
and modification time, so two checkouts or two venvs of the same pagedkv would each compile
the kernels again (tens of seconds). Instead the kernels' source is copied once into

    $PAGEDKV_CACHE_DIR (default: $XDG_CACHE_HOME/pagedkv or ~/.cache/pagedkv)
        /cpu-kernels/<hash of sources + Python + Numba versions>/kernels.py, matvec.py

and imported from there: every install whose kernels are byte-identical shares one copy
and so one Numba cache (`__pycache__/` beside it); the files of `_SOURCES` (the attention
kernels, the matrix-vector kernel, the decoder stack that calls both) share one directory
and one key. A marker per cache dtype (`compiled-float32`, ...) records that the variants
an engine of that dtype runs were built; until it exists, `announce()` prints one line on
stderr.

Standard library only (and outside `pagedkv.ops`, which imports torch): the CLI calls
`announce()` before importing torch or Numba, so the line comes at once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

_KERNELS = Path(__file__).parent / "ops" / "cpu"
_DENSE = Path(__file__).parent / "ops" / "cpu_dense"
_SOURCES = (_KERNELS / "kernels.py", _DENSE / "matvec.py", _DENSE / "layers.py")
"""The compiled-code files; each imports only NumPy, Numba, `_IMPORTED` and (through
`load_kernels`) the files before it."""
_IMPORTED = (_KERNELS / "bf16.py", _DENSE / "atomics.py")
"""Files the kernels import: Numba's cache cannot see them change, so they are in the key."""
_MARKER = "compiled"
COMPILE_SECONDS = 40
"""About how long building one dtype's kernels takes once on a small machine (said to the
user)."""

_announced = False


def cache_root() -> Path:
    """The user-wide cache directory of pagedkv."""
    root = os.environ.get("PAGEDKV_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"


def kernel_dir() -> Path:
    """The directory of this kernel source's shared copy (it may not exist yet)."""
    try:
        numba_version = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba_version = "none"
    key = hashlib.sha256()
    for path in (*_SOURCES, *_IMPORTED):
        key.update(path.read_bytes())
    key.update(f"{sys.version_info[:2]} {numba_version}".encode())
    return cache_root() / "cpu-kernels" / key.hexdigest()[:16]


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
        f"pagedkv: compiling CPU kernels once, about {COMPILE_SECONDS} s; cached in {kernel_dir()}",
        file=sys.stderr,
        flush=True,
    )


def mark_compiled(dtype: str) -> None:
    """Record that the kernels of `dtype` are in the cache (called after its warm-up)."""
    try:
        (kernel_dir() / f"{_MARKER}-{dtype}").touch()
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


def load_kernels(stem: str = "kernels") -> ModuleType:
    """Import `stem`.py of `_SOURCES` from its shared copy (the packaged file if that cannot
    be made)."""
    source = next(path for path in _SOURCES if path.stem == stem)
    directory = kernel_dir()
    path = directory / source.name
    try:
        if not path.exists():
            # Its modification time (part of Numba's cache key) never changes afterwards.
            write_whole(path, source.read_bytes())
    except OSError:
        path = source
    name = f"pagedkv_cpu_{stem}_{directory.name}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, f"cannot import {path}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
