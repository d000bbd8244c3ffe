"""Typed exceptions shared by every layer (standard library only)."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of pagedkv's own errors."""


class OutOfBlocks(PagedKVError):
    """The block pool (device or host) cannot serve a request right now.

    Running out is a normal event: the caller queues, preempts or rejects. The
    operation that raised it left every piece of state unchanged.
    """


class EngineFailed(PagedKVError, RuntimeError):
    """The engine cannot go on (a part of it is gone); every request after it fails too."""


class WorkerFailed(EngineFailed):
    """A tensor-parallel worker process died or raised.

    Attributes:
        rank: the worker's rank, or None when the failed collective did not tell which.
        reason: its error (with traceback when it reported one) or its exit code.
    """

    def __init__(self, rank: int | None, reason: str) -> None:
        who = f"tensor-parallel rank {rank}" if rank is not None else "a tensor-parallel rank"
        super().__init__(f"{who} failed: {reason.strip()}")
        self.rank = rank
        self.reason = reason
