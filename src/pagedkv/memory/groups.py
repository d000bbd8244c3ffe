"""KV cache groups: layers that share an attention kind keep their own block tables in one
pool (standard library only).

A block id covers the layers of one group only, so a sliding-window group can hand back
the blocks that slid out of its window while a full-attention group keeps every block.
Groups hold equally many layers (the fewest layers of any kind; the last group of a kind
may hold fewer), so a block is the same bytes whichever group holds it: the cache tensor
is ``[2, layers_per_group, num_blocks, block_size, num_kv_heads, head_dim]`` and layer l
reads row ``slot(l)`` of its group's blocks.

One group's blocks of a sequence (``window`` W, block size B)::

    block_ids  [ -1 | -1 | b2 | b3 | b4 ]     -1: slid out, never read, back in the pool
                           '- the block holding position (first new token - W + 1)
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.block_tokens import BlockTokens
from pagedkv.memory.content_hash import next_name
from pagedkv.memory.prefix import ChainRoot, PrefixIndex, PrefixName

# A block table entry of a block that slid out of its group's window.
NULL_BLOCK = -1


@dataclass(frozen=True)
class KVGroups:
    """The model's layers split into groups.

    Attributes:
        windows: per group, its layers' sliding window (None: full attention).
        layers: per group, its layer indices in slot order.
        layers_per_group: layers a block covers (the slots of the cache tensor).
    """

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def slot_of(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` of `layer`. Raises ValueError for a layer in no group."""
        for group, layers in enumerate(self.layers):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer: expected one of the model's layers, got {layer!r}")


def group_layers(sliding_windows: Sequence[int | None], num_layers: int) -> KVGroups:
    """Split `num_layers` layers into groups by attention kind.

    Args:
        sliding_windows: per layer its window (None: full attention); empty: every layer
            attends fully.
        num_layers: the model's layers (> 0).

    Returns:
        One group per kind when there is one kind; else each kind cut into groups of the
        fewest layers any kind has, in order of the kinds' first layers.

    Raises:
        ValueError: `sliding_windows` is neither empty nor one entry per layer.
    """
    windows = tuple(sliding_windows) or (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"sliding_windows: expected {num_layers} entries, got {len(windows)}")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    groups = [
        (window, tuple(layers[i : i + size]))
        for window, layers in kinds.items()
        for i in range(0, len(layers), size)
    ]
    return KVGroups(tuple(w for w, _ in groups), tuple(ls for _, ls in groups), size)


def anchor_group(windows: Sequence[int | None]) -> int:
    """The group whose blocks are keyed as a chain from the prompt's root: the first
    full-attention group, else (every group sliding) the one with the widest window.

    A full-attention anchor names the prefix through block i by its entry's uid, so a hit
    spans its chain of cached blocks from the root; every other group keys block i under
    that name, so it needs only the blocks its window reaches at the hit point. With no
    full-attention group the anchor names prefixes by their content hash instead
    (`pagedkv.memory.content_hash.chain_start`): a name computed from the tokens alone, so
    the anchor too needs only the blocks its window reaches, evicted ones before it aside.
    """
    if None in windows:
        return windows.index(None)
    return max(range(len(windows)), key=lambda g: windows[g] or 0)


def sequence_blocks(
    windows: Sequence[int | None], num_tokens: int, block_size: int
) -> tuple[int, ...]:
    """Per group (`windows`: its window, None for full attention), the most blocks one
    sequence of `num_tokens` tokens holds while it decodes: every block of a full-attention
    group, at most ``ceil(window / block_size) + 1`` of a sliding one."""
    blocks = -(-num_tokens // block_size)
    return tuple(
        blocks if window is None else min(blocks, -(-window // block_size) + 1)
        for window in windows
    )


def first_needed_block(window: int | None, position: int, block_size: int) -> int:
    """The first block a token at `position` (and every later one) attends to."""
    return 0 if window is None else max(0, position - window + 1) // block_size


@dataclass(slots=True, eq=False)
class GroupBlocks:
    """One sequence's blocks in one group (device or host, ``array('i')``)."""

    # Device blocks in logical order; the leading `num_dropped` are NULL_BLOCK (slid out).
    block_ids: array[int]
    # Leading full blocks already offered to the prefix index, and the name of the prefix
    # through the last of them (the parent of the next full block's key).
    num_keyed: int
    chain_uid: ChainRoot
    num_dropped: int = 0
    # The held blocks (those after the dropped ones) while swapped out, else None.
    host_block_ids: array[int] | None = None
    # Whether this (anchor) group names prefixes by content hash, not by entry uid.
    hashed: bool = False

    @property
    def held(self) -> array[int]:
        """The device blocks held (none of them NULL_BLOCK)."""
        return self.block_ids[self.num_dropped :]

    def append_cost(self, num_tokens: int, num_new: int, block_size: int, pool: BlockPool
                    ) -> tuple[int, bool]:  # fmt: skip
        """Free blocks `num_new` tokens after `num_tokens` take, and whether one of them
        replaces the shared, partially filled last block (copy-on-write)."""
        is_cow = bool(num_new and num_tokens % block_size and pool.is_shared(self.block_ids[-1]))
        num = -(-(num_tokens + num_new) // block_size) - len(self.block_ids)
        return num + is_cow, is_cow

    def in_place_end(self, num_tokens: int, window: int | None, block_size: int,
                     pool: BlockPool) -> int:  # fmt: skip
        """The most tokens the sequence (holding `num_tokens` now) may hold before an append
        changes these blocks: a new block, a copy of the shared partial last block, or a
        block sliding out of `window`."""
        if num_tokens % block_size and pool.is_shared(self.block_ids[-1]):
            return num_tokens
        end = len(self.block_ids) * block_size
        if window is None:
            return end
        # An append ending here starts at a position p < the bound, whose first block read,
        # (p - window + 1) // block_size, is then at most `num_dropped`.
        return min(end, (self.num_dropped + 1) * block_size + window - 1)

    def num_released(self, first_needed: int, pool: BlockPool) -> int:
        """Blocks `drop(first_needed)` would return to the free pool (those it alone holds)."""
        extra = pool.extra_refs
        return sum(not extra[b] for b in self.block_ids[self.num_dropped : first_needed])

    def take(self, num_blocks: int, is_cow: bool, pool: BlockPool) -> tuple[int, int] | tuple[()]:
        """Append `num_blocks` fresh blocks (the caller checked they are free); with `is_cow`
        the first replaces the shared last block: returns the copy ``(src, dst)`` to queue."""
        new = [pool.allocate_one()] if num_blocks == 1 else pool.allocate(num_blocks).tolist()
        copy: tuple[int, int] | tuple[()] = ()
        if is_cow:
            copy = src, dst = self.block_ids[-1], new.pop(0)
            pool.free([src])  # shared, so it stays held by the others
            self.block_ids[-1] = dst
        self.block_ids.extend(new)
        return copy

    def drop(self, first_needed: int, pool: BlockPool) -> bool:
        """Return the blocks before `first_needed` to `pool` (they slid out of the window);
        whether any did."""
        start = self.num_dropped
        if first_needed <= start:
            return False
        pool.free(self.block_ids[start:first_needed])
        self.block_ids[start:first_needed] = array("i", [NULL_BLOCK]) * (first_needed - start)
        self.num_dropped = first_needed
        return True

    def key_chain(self, index: PrefixIndex, keys: Sequence[BlockTokens], uids: list[PrefixName]
                  ) -> None:  # fmt: skip
        """Key the full blocks from `num_keyed` on (`keys`, one per block) as a chain, and
        append each one's name (of the prefix through it) to `uids`. By uid, blocks that slid
        out before they were keyed break the chain: the rest chain from a fresh uid, which no
        lookup reaches (the blocks of the gap get it too)."""
        if self.hashed:
            self._key_hashed(index, keys, uids)
            return
        start = self.num_keyed
        if start < self.num_dropped:
            num_gap = self.num_dropped - start
            fresh = self.chain_uid = index.fresh_uid()
            uids += [fresh] * num_gap
            keys, start = keys[num_gap:], self.num_dropped
        end = start + len(keys)
        self.chain_uid = index.insert_keys(self.chain_uid, keys, self.block_ids[start:end], uids)
        self.num_keyed = end

    def _key_hashed(self, index: PrefixIndex, keys: Sequence[BlockTokens],
                    names: list[PrefixName]) -> None:  # fmt: skip
        """`key_chain` by content: block i keyed under the name of blocks 0 .. i-1, held
        blocks only (a slid-out block's name is still computed from its tokens)."""
        start, parent = self.num_keyed, self.chain_uid
        parents: list[ChainRoot] = []
        for tokens in keys:
            parents.append(parent)
            parent = next_name(index, parent, tokens)
            names.append(parent)
        first = max(start, self.num_dropped) - start
        end = start + len(keys)
        index.insert_under(parents[first:], keys[first:], self.block_ids[start + first : end])
        self.chain_uid, self.num_keyed = parent, end

    def key_under(self, index: PrefixIndex, keys: Sequence[BlockTokens],
                  uids: Sequence[PrefixName], group: int) -> None:  # fmt: skip
        """Key the held full blocks from `num_keyed` on (`keys`, one per block), block i
        under ``(group, uids[i])``: the anchor group's name of the prefix through it, so a
        lookup needs only the blocks its window reaches (see `anchor_group`)."""
        start, end = self.num_keyed, self.num_keyed + len(keys)
        first = max(start, self.num_dropped)
        parents: list[ChainRoot] = [(group, uid) for uid in uids[first:end]]
        index.insert_under(parents, keys[first - start :], self.block_ids[first:end])
        self.num_keyed = end
