"""Typed exceptions shared by every layer (standard library only)."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of pagedkv's own errors."""


class OutOfBlocks(PagedKVError):
    """The block pool (device or host) cannot serve a request right now.

    Running out is a normal event: the caller queues, preempts or rejects. The
    operation that raised it left every piece of state unchanged.
    """


class InvalidRequest(PagedKVError, ValueError):
    """A request the engine can never serve (bad parameters, too long for the pool)."""
