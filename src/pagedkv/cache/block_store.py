"""A directory of KV blocks keyed by content hash: the disk tier's files.

One file per block, ``DIR/<namespace>/<hash[:2]>/<hash>.kvb``::

    header   magic "PKVB" | version u16 | 0 u16 | num_tokens u32 | data bytes u64
    hash     32 bytes: the block's content hash (`pagedkv.memory.content_hash`)
    parent   32 bytes: its parent's content hash
    tokens   num_tokens x int32
    data     the block's KV as `PagedKVCache.read_blocks` gives it
    crc32    u32 over everything before it

Crash safety: a file is written under a temporary name of the writing process and renamed
into place, so a reader sees a whole file or none (no fsync: after a power loss a file may
be torn, which the length and checksum catch). A read checks the length, the checksum and
that hash, parent and tokens are the ones asked for: anything else is a miss and the file
is deleted. Processes sharing a directory never write the same temporary name, and a
rename replaces a file atomically, so they do not corrupt each other's blocks.

The index of what is on disk (name -> size) is read from the namespace at start; blocks
other processes write later are learnt when looked up. The capacity is the directory's, all
namespaces and processes together (`DirectoryBudget`): the least recently used files go,
whichever process wrote them (a write stamps a file's time and a hit refreshes it). A file
another process deleted stays in this index until a read of it fails (a miss).

Standard library only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

from pagedkv.cache.disk_budget import DirectoryBudget

_MAGIC = b"PKVB"
_VERSION = 1
_HEADER = struct.Struct("<4sHHIQ")
_HASH_BYTES = 32
_CRC = struct.Struct("<I")
_SUFFIX = ".kvb"
# A temporary file of a live process younger than this is another writer's, kept.
_STALE_TMP_SECONDS = 3600.0


class BlockStore:
    """Files of KV blocks under ``root/namespace``; `root` holds at most `capacity` bytes
    of them (LRU, shared with every store on `root`).

    Args:
        root: the directory (created if missing).
        namespace: a name for what makes KV comparable (model, dtype, block size, ...):
            blocks of other namespaces are never read.
        capacity: bytes of block files to keep under `root` at most (> 0).
        description: written as ``namespace.json`` beside the blocks, for people.

    Raises:
        OSError: the directory cannot be created or written.
        ValueError: `capacity` <= 0.
    """

    def __init__(
        self, root: str, namespace: str, capacity: int, description: dict[str, Any] | None = None
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: expected > 0 bytes, got {capacity}")
        self.directory = os.path.join(root, namespace)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._files: dict[str, int] = {}  # name -> bytes
        self._tmp_names = itertools.count()
        self.num_bytes = 0
        self.num_evictions = 0  # files this process deleted for room (any namespace's)
        self.num_corrupt = 0
        self.num_failed_reads = 0  # corrupt, or gone since it was found
        self.num_hits = self.num_misses = self.bytes_read = self.bytes_written = 0
        os.makedirs(self.directory, exist_ok=True)
        self._write_atomic(
            os.path.join(self.directory, "namespace.json"),
            [json.dumps(description or {}, indent=1, sort_keys=True).encode()],
        )
        self._budget = DirectoryBudget(root, capacity)
        self._scan()
        self._evicted(self._budget.rescan())

    # ----- the index ------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name[:2], name + _SUFFIX)

    def _scan(self) -> None:
        """Index the namespace's block files; drop dead temporaries."""
        for sub in os.scandir(self.directory):
            if not sub.is_dir():
                continue
            for item in os.scandir(sub.path):
                try:
                    info = item.stat()
                except OSError:
                    continue
                if item.name.endswith(_SUFFIX):
                    self._files[item.name[: -len(_SUFFIX)]] = info.st_size
                    self.num_bytes += info.st_size
                elif item.name.endswith(".tmp") and _is_stale(item.name, info.st_mtime):
                    with contextlib.suppress(OSError):
                        os.unlink(item.path)

    def __len__(self) -> int:
        return len(self._files)

    def contains(self, content_hash: bytes) -> bool:
        """Whether a file for `content_hash` is known or on disk (not yet verified)."""
        name = content_hash.hex()
        with self._lock:
            if name in self._files:
                return True
        try:
            size = os.stat(self._path(name)).st_size
        except OSError:
            return False
        with self._lock:  # another process wrote it: learn it
            if name not in self._files:
                self._files[name] = size
                self.num_bytes += size
        return True

    def _forget(self, name: str) -> None:
        size = self._files.pop(name, None)
        if size is not None:
            self.num_bytes -= size

    def _evicted(self, paths: list[str]) -> None:
        """Count the files the budget deleted; forget those of this namespace."""
        with self._lock:
            self.num_evictions += len(paths)
            for path in paths:
                if os.path.dirname(os.path.dirname(path)) == self.directory:
                    self._forget(os.path.basename(path).removesuffix(_SUFFIX))

    # ----- writes and reads -----------------------------------------------------------------

    def write(self, content_hash: bytes, parent_hash: bytes, tokens: bytes, data: Any) -> int:
        """Store one block unless a file for it exists.

        Args:
            content_hash, parent_hash: 32-byte digests.
            tokens: the block's tokens as int32 bytes.
            data: its KV, any buffer (bytes, memoryview, a uint8 array).

        Returns:
            Bytes written (0: already stored).

        Raises:
            OSError: the file could not be written (a full disk, a removed directory).
        """
        if self.contains(content_hash):
            return 0
        payload = memoryview(data).cast("B")
        header = _HEADER.pack(_MAGIC, _VERSION, 0, len(tokens) // 4, payload.nbytes)
        parts: list[bytes | memoryview] = [header, content_hash, parent_hash, tokens, payload]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        parts.append(_CRC.pack(crc))
        name = content_hash.hex()
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size = self._write_atomic(path, parts)
        with self._lock:
            if name not in self._files:
                self._files[name] = size
                self.num_bytes += size
            self.bytes_written += size
        self._evicted(self._budget.add(size))
        return size

    def _write_atomic(self, path: str, parts: Sequence[Any]) -> int:
        """Write `parts` to a temporary name of this process, then rename it to `path`."""
        tmp = f"{path}.{os.getpid()}.{next(self._tmp_names)}.tmp"
        try:
            with open(tmp, "wb") as file:
                for part in parts:
                    file.write(part)
                size = file.tell()
            _touch(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    def read(self, content_hash: bytes, parent_hash: bytes, tokens: bytes) -> bytearray | None:
        """The KV of the block stored for `content_hash`, verified; None on a miss.

        A file that is torn, corrupt or holds another block (parent or tokens differ) is
        deleted and is a miss.
        """
        name = content_hash.hex()
        path = self._path(name)
        try:
            with open(path, "rb") as file:
                raw = bytearray(os.fstat(file.fileno()).st_size)
                num_read = file.readinto(raw)
            del raw[num_read:]  # shorter if another process replaced the file meanwhile
        except OSError:
            with self._lock:
                self._forget(name)
                self.num_failed_reads += 1
            return None
        data = _verified(raw, content_hash, parent_hash, tokens)
        with self._lock:
            if data is None:
                self._forget(name)
                self.num_corrupt += 1
                self.num_failed_reads += 1
            else:
                self.num_hits += 1
                self.bytes_read += len(data)
        if data is None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        with contextlib.suppress(OSError):  # the least recently used order, for every process
            _touch(path)
        return data


def _verified(
    raw: bytearray, content_hash: bytes, parent_hash: bytes, tokens: bytes
) -> bytearray | None:
    """The data part of a file's bytes if they are whole and hold exactly this block."""
    if len(raw) < _HEADER.size + 2 * _HASH_BYTES + _CRC.size:
        return None
    magic, version, _, num_tokens, num_data = _HEADER.unpack_from(raw)
    start = _HEADER.size + 2 * _HASH_BYTES + 4 * num_tokens
    if magic != _MAGIC or version != _VERSION or len(raw) != start + num_data + _CRC.size:
        return None
    if _CRC.unpack_from(raw, len(raw) - _CRC.size)[0] != zlib.crc32(memoryview(raw)[: -_CRC.size]):
        return None
    fields = bytes(raw[_HEADER.size : start])
    if fields != content_hash + parent_hash + tokens:
        return None
    del raw[start + num_data :]
    del raw[:start]
    return raw


def _touch(path: str) -> None:
    """Stamp `path` with the time now, to the nanosecond: the file system's own stamps are
    as coarse as the kernel's tick, which would tie blocks written in one burst."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _is_stale(name: str, mtime: float) -> bool:
    """Whether a temporary file was left by a process that is gone (or is very old)."""
    try:
        pid = int(name.split(".")[-3])
    except (IndexError, ValueError):
        return True
    if time.time() - mtime > _STALE_TMP_SECONDS:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
