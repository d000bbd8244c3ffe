"""Per-sequence state of the KV-cache manager, and input validation (standard library only)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.memory.prefix import ROOT_UID, ChainRoot

SeqId = Hashable


@dataclass(slots=True, eq=False)
class SeqState:
    """One sequence's state: its blocks (device or host, ``array('i')``) and its tokens."""

    block_ids: array[int]
    # The prompt stays the tuple `allocate` packed its keys from (no second copy) until
    # the first `append` turns it into a list.
    token_ids: list[Any] | tuple[Any, ...]
    # Leading full blocks already offered to the prefix index, and the uid naming the
    # prefix through the last of them (the parent of the next full block's key).
    num_keyed: int
    chain_uid: ChainRoot
    # Host blocks while swapped out (block_ids is then empty), else None.
    host_block_ids: array[int] | None = None
    # `block_ids` as the list handed out by `KVCacheManager.append_token`, or None once
    # the blocks changed: replaced, never mutated, since a step may still read the old one.
    table: list[int] | None = None
    # True when resident, `token_ids` is a list and a partially filled last block is
    # this sequence's alone, so `append_token` writes into it without asking the pool
    # (or, when the last block is full, takes one fresh block). Only a fork shares a
    # partial block (prefix hits are on full blocks), and a non-empty `append` leaves
    # the last block unshared (written in place, fresh, or copied).
    is_tail_own: bool = False
    # The parent of the first block's key: ROOT_UID, or the prompt's salt (`chain_root`).
    chain_root: ChainRoot = ROOT_UID


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return `value` if it is an int >= `minimum`.

    Raises:
        ValueError: otherwise, "name: expected an int >= minimum, got value".
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def token_tuple(token_ids: Sequence[Any]) -> tuple[Any, ...]:
    """`token_ids` as a tuple (a tuple is returned as is: it cannot change under us).

    Raises:
        ValueError: `token_ids` is not iterable, or is a str or bytes.
    """
    if not isinstance(token_ids, (str, bytes)):
        try:
            return tuple(token_ids)
        except TypeError:
            pass
    raise ValueError(f"token_ids: expected a sequence of token ids, got {type(token_ids)}")
