"""One byte budget for every block file under a directory, shared by the processes using it.

Servers (and tensor-parallel ranks, one namespace each) that share a prefix cache directory
keep its files, all namespaces together, within one capacity. A ledger file holds the
directory's total; a writer adds its file's bytes under an exclusive lock (``flock``)::

    ROOT/budget                  the ledger: total bytes of block files, as text
    ROOT/<namespace>/<xx>/*.kvb  block files (`pagedkv.cache.block_store`)

When the total passes the capacity, the writer (still holding the lock) scans every
namespace and deletes the least recently used files, oldest modification time first (a
read refreshes a file's time), down to a low-water mark below the capacity, and writes the
total it counted. The scan also corrects the ledger: a process killed between its rename
and its ledger update, or a file deleted by hand, leaves the ledger off until the next scan;
each start scans too.

Standard library only; POSIX (``fcntl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator

# A scan evicts down to this fraction of the capacity, so that the directory is scanned
# once per that share of the capacity written rather than on every write when full.
_LOW_WATER = 0.9
_SUFFIX = ".kvb"


class DirectoryBudget:
    """The block files under `root`, at most `capacity` bytes in all, across processes.

    Args:
        root: the prefix cache directory (exists).
        capacity: bytes of block files to keep at most (> 0).

    Raises:
        OSError: the ledger cannot be created.
    """

    def __init__(self, root: str, capacity: int) -> None:
        self.root = root
        self.capacity = capacity
        self._lock = threading.Lock()
        self._ledger = open(os.path.join(root, "budget"), "a+b")  # noqa: SIM115 - held open

    def add(self, num_bytes: int) -> list[str]:
        """Count `num_bytes` of a file just written; evict if the directory is over.

        Returns:
            The paths of the files deleted to make room (any namespace's).
        """
        with self._locked():
            total = self._read_total() + num_bytes
            deleted: list[str] = []
            if total > self.capacity:
                total, deleted = self._evict()
            self._write_total(total)
        return deleted

    def rescan(self) -> list[str]:
        """Count the directory anew (evicting if it is over); the deleted paths."""
        with self._locked():
            total, deleted = self._evict()
            self._write_total(total)
        return deleted

    def _evict(self) -> tuple[int, list[str]]:
        """Count every block file; if they pass the capacity, delete the least recently
        used down to the low-water mark. (the bytes that remain, the deleted paths)"""
        files = sorted(_block_files(self.root))
        total = sum(size for _, _, size in files)
        if total <= self.capacity:
            return total, []
        deleted: list[str] = []
        for _, path, size in files:
            if total <= self.capacity * _LOW_WATER:
                break
            with contextlib.suppress(FileNotFoundError):  # another process got there first
                os.unlink(path)
                deleted.append(path)
            total -= size
        return total, deleted

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's threads one at a time, and other processes' budgets waiting."""
        with self._lock:
            fcntl.flock(self._ledger.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._ledger.fileno(), fcntl.LOCK_UN)

    def _read_total(self) -> int:
        self._ledger.seek(0)
        try:
            return int(self._ledger.read().decode() or 0)
        except ValueError:  # a torn or foreign ledger: over, so the directory is counted
            return self.capacity + 1

    def _write_total(self, total: int) -> None:
        self._ledger.seek(0)
        self._ledger.truncate()
        self._ledger.write(str(total).encode())
        self._ledger.flush()


def _block_files(root: str) -> Iterator[tuple[int, str, int]]:
    """(modification time in ns, path, bytes) of every block file of every namespace."""
    for namespace in _subdirectories(root):
        for sub in _subdirectories(namespace):
            for item in _entries(sub):
                if item.name.endswith(_SUFFIX):
                    with contextlib.suppress(OSError):
                        info = item.stat()
                        yield info.st_mtime_ns, item.path, info.st_size


def _subdirectories(path: str) -> Iterator[str]:
    for item in _entries(path):
        with contextlib.suppress(OSError):
            if item.is_dir(follow_symlinks=False):
                yield item.path


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as items:
            return list(items)
    except OSError:  # removed meanwhile
        return []
