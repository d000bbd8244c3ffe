"""Canonical block tokens: a block's tokens in the form the prefix index keys and compares.

``block_tokens`` is canonical for the block's tokens alone: the bytes of the tokens packed as
int32 when every token is an int that fits (the usual case), else the tuple of the tokens
(a bytes key never equals a tuple key). Packing a whole prompt is one ``struct`` call and
cutting it into blocks another; bytes compare with ``memcmp``, so every token of a hit is
still compared with the cached one, at C speed.

Standard library only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any

BlockTokens = bytes | tuple[Any, ...]
# Cached struct formats, per length; cleared past this many (lengths are bounded by prompts).
_MAX_FORMATS = 4096


def iter_full_blocks(
    token_ids: Sequence[Any], block_size: int, start: int = 0, stop: int | None = None
) -> Iterator[tuple[Any, ...]]:
    """Yield the token tuples of full blocks ``start <= i < stop`` (stop None: every full
    block), each exactly ``block_size`` tokens (a partial last block is skipped)."""
    num_full = len(token_ids) // block_size
    stop = num_full if stop is None else min(stop, num_full)
    if stop <= start:
        return iter(())
    # zip over one iterator taken block_size times cuts the list into tuples in C.
    tokens = iter(token_ids[start * block_size : stop * block_size])
    return zip(*[tokens] * block_size, strict=False)


class BlockPacker:
    """Packs tokens into canonical block tokens, keeping one ``struct`` format per length."""

    __slots__ = ("_packers", "_splitters")

    def __init__(self) -> None:
        # struct.Struct per token count (packing) and per (block count, block bytes) (cutting).
        self._packers: dict[int, struct.Struct] = {}
        self._splitters: dict[tuple[int, int], struct.Struct] = {}

    def _pack(self, token_ids: Sequence[Any]) -> bytes | None:
        """The tokens as int32 bytes, or None if one is not an int in int32 range."""
        packer = self._packers.get(len(token_ids))
        if packer is None:
            if len(self._packers) >= _MAX_FORMATS:
                self._packers.clear()
            packer = self._packers[len(token_ids)] = struct.Struct(f"={len(token_ids)}i")
        try:
            return packer.pack(*token_ids)
        except (struct.error, TypeError):
            return None

    def pack(self, token_ids: Sequence[Any]) -> bytes | None:
        """The tokens as int32 bytes (see the module docstring), or None if one does not fit."""
        return self._pack(token_ids)

    def block_tokens(self, tokens: Sequence[Any]) -> BlockTokens:
        """The canonical form of one block's tokens (int32 bytes, else a tuple)."""
        packed = self._pack(tokens)
        return tuple(tokens) if packed is None else packed

    def _split(self, packed: bytes, width: int, start: int, stop: int) -> tuple[bytes, ...]:
        """Blocks ``start <= i < stop`` of `packed` (`width` bytes each), cut in one C call."""
        if stop <= start:
            return ()
        shape = (stop - start, width)
        splitter = self._splitters.get(shape)
        if splitter is None:
            if len(self._splitters) >= _MAX_FORMATS:
                self._splitters.clear()
            splitter = self._splitters[shape] = struct.Struct(f"{width}s" * shape[0])
        return splitter.unpack_from(packed, start * width)

    def keys_of(
        self, token_ids: Sequence[Any], block_size: int, start: int = 0
    ) -> Sequence[BlockTokens]:
        """Canonical tokens of the full blocks from block `start` on.

        Returns:
            One `block_tokens` per full block, equal to what `block_tokens` gives for each
            block alone (so keys never depend on the rest of the prompt).
        """
        stop = len(token_ids) // block_size
        if stop <= start:
            return ()
        packed = self._pack(token_ids[start * block_size : stop * block_size])
        if packed is None:  # some block holds a non-int32 token: block by block
            blocks = iter_full_blocks(token_ids, block_size, start)
            if stop - start == 1:  # that block, whose packing just failed (a decode step's)
                return list(blocks)
            return [self.block_tokens(block) for block in blocks]
        if stop - start == 1:  # a decode step's newly full block: nothing to cut
            return (packed,)
        return self._split(packed, 4 * block_size, 0, stop - start)
