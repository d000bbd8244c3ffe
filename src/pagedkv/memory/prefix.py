"""Prefix index: full blocks findable by a chained key, verified on every hit.

A block's key is ``(parent_uid, block_tokens)``: the uid of the entry for the block before it
(the chain's root for a sequence's first block) and the block's ``block_size`` tokens. Every entry
gets a fresh uid that is never reused, so a key names one whole prefix: block ``i`` matches
only if blocks ``0 .. i-1`` matched the same entries, and an entry left behind by an evicted
parent can never be reached again.

A chain's root is ``ROOT_UID``, or a salt (a str, see `chain_root`): a salted prompt's first
key is ``(salt, block_tokens)``, so prompts with different salts share no block (every later
block chains from a uid of the salted chain), while prompts with the same salt share as
unsalted ones do. The salt is part of the key itself, compared in full on every hit like the
tokens, so two salts whose hashes collide still never share a block.

``block_tokens`` is the block's tokens in canonical form (`pagedkv.memory.block_tokens`):
int32 bytes, compared with ``memcmp``, so every token of a hit is compared with the cached one.

The key is the dict key itself, so a lookup compares the stored tokens and parent uid with the
prompt's (Python's dict checks equality after the hash matches): two prompts whose keys hash
alike can never share a block. The hash is only an index.

With several KV cache groups only the anchor group's blocks chain (see
`pagedkv.memory.groups.anchor_group`); another group's block is keyed `insert_under` the pair
``(group, anchor's name of the same prefix)``: found by `block_of` without a walk.

A sliding-window anchor (no full-attention group) names prefixes by content instead
(`pagedkv.memory.content_hash`): its block i is keyed ``(hash of blocks 0 .. i-1,
block_tokens)`` with `insert_under`, so a lookup (`pagedkv.memory.lookups`) finds it from
the prompt's tokens alone, with no walk through blocks that slid out and were evicted.

Spans make a repeated hit cost less than one dict lookup per block: once a lookup has walked
``span_blocks`` aligned blocks of a chain, the next one matches them at once, comparing the
bytes of all their tokens in one ``memcmp`` and checking in C that every block still holds
the entry the walk found (entries are never reused). A span that fails the check (a block
was evicted) is ignored, so a span hit is exactly what the walk would find.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Protocol

from pagedkv.memory.block_tokens import BlockPacker, BlockTokens

# The uid a sequence's first block chains from; entries get uids 1, 2, 3, ...
ROOT_UID = 0

# The name of a prefix: an entry's uid, or (a sliding anchor's) the content hash of its blocks.
PrefixName = int | bytes
# The parent of a block's key: ROOT_UID, a salt or a prefix's name; ``(group, any of these)``
# in a KV cache group other than the anchor (or after the first).
ChainRoot = int | str | bytes | tuple[int, int | str | bytes]
BlockKey = tuple[ChainRoot, BlockTokens]
# (block_id, uid, key): one tuple per indexed block, never reused (its uid is fresh).
Entry = tuple[int, int, BlockKey]


class EntryObserver(Protocol):
    """Told of every entry the index adds and every entry the pool evicts (`ContentHashes`)."""

    def add(self, uid: int, key: BlockKey) -> None: ...

    def evict(self, entry: Entry) -> None: ...

    def clear(self) -> None: ...


# Blocks matched by one span lookup (see PrefixIndex._spans): 16 blocks of 16 tokens are 256
# tokens, shorter than most system prompts; longer spans save little more per block.
SPAN_BLOCKS = 16


def chain_root(salt: str | None) -> ChainRoot:
    """The parent of a prompt's first block: ``ROOT_UID`` without a salt, else the salt
    itself (a str never equals an int uid, nor another salt)."""
    return ROOT_UID if salt is None else salt


def group_root(root: ChainRoot, group: int) -> ChainRoot:
    """The chain root in KV cache group `group` of a prompt whose root is `root`: the same
    in the first group, paired with the group after it, so groups never share a chain."""
    return root if group == 0 else (group, root)  # type: ignore[return-value]


class PrefixIndex(BlockPacker):
    """Map chained block keys to the blocks that hold them.

    Invariants (checked by `check`): each entry's block points back at the entry's key
    (``block_entries[block_id]`` is the entry), at most one entry per block, and uids are
    unique.
    Duplicates (a second block with the same prefix, e.g. two sequences that generated the
    same text) are not indexed; they share the first entry's uid as their chain position.
    """

    __slots__ = ("_entries", "block_entries", "_next_uid", "_spans", "span_blocks", "content")

    def __init__(self, num_blocks: int, span_blocks: int = SPAN_BLOCKS) -> None:
        if span_blocks < 2:
            raise ValueError(f"span_blocks: expected >= 2, got {span_blocks}")
        super().__init__()
        # key -> (block_id, uid, key); one Python tuple per cached block (the index, not the
        # pool). An entry compares equal only to itself (its uid is never reused).
        self._entries: dict[BlockKey, Entry] = {}
        # block_id -> its entry while indexed, else None: 8 bytes per block.
        self.block_entries: list[Entry | None] = [None] * num_blocks
        self._next_uid = ROOT_UID + 1
        # Spans (see the module docstring): key of a chain's block -> (getter, tokens,
        # entries, block_ids, uid of the last) for the `span_blocks` blocks from it, live iff
        # ``getter(block_entries) == entries``. Only chains of bytes keys get spans;
        # `span_blocks` >= 2 (tests lower it).
        self._spans: dict[BlockKey, tuple[Any, bytes, tuple[Entry, ...], list[int], ChainRoot]] = {}
        self.span_blocks = span_blocks
        # Content hashes of the entries, for a tier that outlives the process (None: off).
        self.content: EntryObserver | None = None

    def __len__(self) -> int:
        return len(self._entries)

    # ----- lookups and updates --------------------------------------------------------------
    def match(
        self,
        token_ids: Sequence[Any],
        block_size: int,
        max_blocks: int,
        packed: bytes | None = None,
        root: ChainRoot = ROOT_UID,
    ) -> tuple[list[int], ChainRoot]:
        """Find the cached blocks holding the leading full blocks of `token_ids`.

        Side-effect free (but for spans, an internal shortcut: see `_match_packed`). Block
        ``i`` matches only if blocks ``0 .. i-1`` matched.

        Args:
            max_blocks: look at most this many leading blocks.
            packed: `pack(token_ids)` when the caller kept it (not None), else computed.
            root: the parent of the first block (`chain_root` of the prompt's salt).

        Returns:
            ``(block_ids, uid)``: the matching blocks in order, and the uid of the last match
            (`root` when nothing matched).
        """
        if packed is not None:
            num = min(max_blocks, len(token_ids) // block_size)
            return self._match_packed(packed, 4 * block_size, num, root)
        return self.lookup(token_ids, block_size, max_blocks, with_rest=False, root=root)[:2]

    def lookup(
        self,
        token_ids: Sequence[Any],
        block_size: int,
        max_blocks: int,
        with_rest: bool = True,
        root: ChainRoot = ROOT_UID,
    ) -> tuple[list[int], ChainRoot, Sequence[BlockTokens]]:
        """`match`, plus the canonical tokens of the full blocks after the matched ones.

        The prompt is packed once (one ``struct`` call, no copy when `token_ids` is a tuple):
        the lookup compares slices of it, and the rest's keys (to index the blocks about to
        be computed) are cut from it.

        Returns:
            ``(block_ids, uid, rest)``: as `match`, and one `block_tokens` per full block
            from ``len(block_ids)`` on (empty unless `with_rest`).
        """
        num_full = len(token_ids) // block_size
        num = min(max_blocks, num_full)
        packed = self._pack(token_ids) if num_full else None
        if packed is None:  # a non-int32 token (or no full block): block by block
            keys = self.keys_of(token_ids, block_size) if num_full else ()
            block_ids, uid = self.match_keys(keys, num, root)
            return block_ids, uid, keys[len(block_ids) :] if with_rest else ()
        width = 4 * block_size
        block_ids, uid = self._match_packed(packed, width, num, root)
        rest = self._split(packed, width, len(block_ids), num_full) if with_rest else ()
        return block_ids, uid, rest

    def match_keys(
        self, keys: Sequence[BlockTokens], max_blocks: int, uid: ChainRoot = ROOT_UID
    ) -> tuple[list[int], ChainRoot]:
        """`match` on block tokens from `keys_of`: the first ``max_blocks`` of `keys`, the
        first of them chained from `uid`."""
        get = self._entries.get
        block_ids: list[int] = []
        for tokens in keys[:max_blocks]:
            entry = get((uid, tokens))
            if entry is None:
                break
            block_ids.append(entry[0])
            uid = entry[1]
        return block_ids, uid

    def _match_packed(
        self, packed: bytes, width: int, num: int, root: ChainRoot
    ) -> tuple[list[int], ChainRoot]:
        """`match` on the packed prompt (`width` bytes per block), ``num`` blocks at most.

        Walks `span_blocks` blocks at a time: a live span (see `_spans`) matches a whole
        chunk at once; else block by block, and a chunk walked whole becomes a span.
        """
        spans, block_entries = self._spans, self.block_entries
        num_span = self.span_blocks
        span_width, end = width * num_span, width * num
        block_ids: list[int] = []
        uid = root
        for start in range(0, end, span_width):
            stop = min(start + span_width, end)
            if stop - start == span_width:
                span = spans.get((uid, packed[start : start + width]))
                # The key proves block 0 (tokens and parent), one memcmp the other tokens, and
                # the entry check that every block still holds the entry the walk found
                # (evictions are not tracked here): then it is exactly what a walk finds.
                if (
                    span is not None
                    and span[1] == packed[start:stop]
                    and span[0](block_entries) == span[2]
                ):
                    block_ids += span[3]
                    uid = span[4]
                    continue
            chunk = self._split(packed, width, start // width, stop // width)
            walked, uid = self.match_keys(chunk, len(chunk), uid)
            block_ids += walked
            if len(walked) < len(chunk):
                return block_ids, uid
            if stop - start == span_width:
                self._add_span(block_ids[-num_span:], uid)
        return block_ids, uid

    def _add_span(self, block_ids: list[int], uid: ChainRoot) -> None:
        """Record that `block_ids` (just walked, all indexed) form one chain ending at `uid`."""
        getter = itemgetter(*block_ids)
        entries = getter(self.block_entries)
        tokens = b"".join(entry[2][1] for entry in entries)
        self._spans[entries[0][2]] = (getter, tokens, entries, block_ids, uid)
        # Live spans are at most one per entry (keyed by their first block's entry): drop
        # dead ones when they outnumber the entries (amortized O(span_blocks) per span).
        if len(self._spans) > 2 * len(self._entries) + 64:
            block_entries = self.block_entries
            self._spans = {k: v for k, v in self._spans.items() if v[0](block_entries) == v[2]}

    def insert(self, parent_uid: ChainRoot, tokens: Sequence[Any], block_id: int) -> ChainRoot:
        """Index `block_id` as holding `tokens` after the prefix `parent_uid`.

        Args:
            parent_uid: the chain position of the block before (the chain's root for the
                first: ``ROOT_UID`` or a salt).
            tokens: the block's ``block_size`` tokens (a tuple or a list).
            block_id: a held block whose KV is (or is being) computed for exactly this prefix.

        Returns:
            The uid naming this prefix: a fresh one, or the existing entry's uid if another
            block already holds the same prefix (then `block_id` stays unindexed).
        """
        return self.insert_keys(parent_uid, [self.block_tokens(tokens)], [block_id])

    def insert_keys(
        self,
        parent_uid: ChainRoot,
        keys: Sequence[BlockTokens],
        block_ids: Sequence[int],
        uids: list[PrefixName] | None = None,
    ) -> ChainRoot:
        """Index consecutive blocks: ``block_ids[i]`` holds ``keys[i]`` (from `keys_of`).

        Args:
            uids: if given, each block's uid (the prefix through it) is appended to it.

        Returns:
            The uid naming the prefix through the last block (see `insert`).
        """
        entries, block_entries = self._entries, self.block_entries
        uid = parent_uid
        for tokens, block_id in zip(keys, block_ids, strict=True):
            assert block_entries[block_id] is None, f"block {block_id} is indexed already"
            key = (uid, tokens)
            entry = entries.get(key)
            if entry is not None:
                uid = entry[1]
            else:
                uid = self._add(key, block_id)
            if uids is not None:
                uids.append(uid)
        return uid

    def insert_under(
        self, parents: Sequence[ChainRoot], keys: Sequence[BlockTokens], block_ids: Sequence[int]
    ) -> None:
        """Index blocks each under its own parent, not chained: ``block_ids[i]`` holds
        ``keys[i]`` after ``parents[i]`` (a block already holding that key leaves it unindexed)."""
        entries, block_entries = self._entries, self.block_entries
        for parent, tokens, block_id in zip(parents, keys, block_ids, strict=True):
            assert block_entries[block_id] is None, f"block {block_id} is indexed already"
            key = (parent, tokens)
            if key not in entries:
                self._add(key, block_id)

    def _add(self, key: BlockKey, block_id: int) -> int:
        """A new entry: `block_id` holds `key`, under a fresh uid (returned)."""
        uid = self._next_uid
        self._next_uid = uid + 1
        self._entries[key] = self.block_entries[block_id] = (block_id, uid, key)
        if self.content is not None:
            self.content.add(uid, key)
        return uid

    def block_of(self, parent: ChainRoot, tokens: BlockTokens) -> int | None:
        """The block indexed under ``(parent, tokens)``, or None."""
        entry = self._entries.get((parent, tokens))
        return None if entry is None else entry[0]

    @property
    def next_uid(self) -> int:
        """The uid the next entry gets: it changes whenever an entry is added."""
        return self._next_uid

    def fresh_uid(self) -> int:
        """A uid no entry has: blocks chained from it are unreachable (a chain with a gap)."""
        uid = self._next_uid
        self._next_uid = uid + 1
        return uid

    def remove(self, block_id: int) -> None:
        """Forget the entry held by `block_id` (eviction); its children become unreachable."""
        entry = self.block_entries[block_id]
        assert entry is not None, f"block {block_id} is not indexed"
        del self._entries[entry[2]]
        self.block_entries[block_id] = None
        if self.content is not None:
            self.content.evict(entry)

    def clear(self) -> None:
        """Forget every entry (uids keep counting up, so old chains stay unreachable)."""
        for entry in self._entries.values():
            self.block_entries[entry[0]] = None
        self._entries.clear()
        self._spans.clear()
        if self.content is not None:
            self.content.clear()

    def check(self) -> None:
        """Assert the index's own invariants.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        uids = set()
        for key, entry in self._entries.items():
            block_id, uid, entry_key = entry
            assert self.block_entries[block_id] is entry and entry_key is key, (
                f"prefix index: key of block {block_id} does not point back at its entry"
            )
            assert uid not in uids, f"prefix index: uid {uid} is used twice"
            parent = key[0]
            assert not isinstance(parent, int) or ROOT_UID <= parent < uid, (
                f"prefix index: block {block_id} chains from uid {parent}, not an older entry"
            )
            uids.add(uid)
        for first_key, (getter, tokens, entries, block_ids, last) in self._spans.items():
            if getter(self.block_entries) != entries:
                continue  # dead: never served
            assert [e[0] for e in entries] == block_ids and entries[0][2] == first_key, (
                f"prefix index: span at blocks {block_ids} does not start at its key"
            )
            assert len(block_ids) == self.span_blocks, (
                f"prefix index: span at blocks {block_ids} is not {self.span_blocks} long"
            )
            assert tokens == b"".join(e[2][1] for e in entries), (  # type: ignore[misc]  # spans are bytes-keyed
                f"prefix index: span at blocks {block_ids} holds other tokens than its entries"
            )
            chain = [e[2][0] for e in entries[1:]] + [last]
            assert chain == [e[1] for e in entries], (
                f"prefix index: span at blocks {block_ids} is not one chain ending at uid {last!r}"
            )
        num_keyed = sum(key is not None for key in self.block_entries)
        assert num_keyed == len(self._entries), (
            f"prefix index: {num_keyed} blocks carry a key but {len(self._entries)} are indexed"
        )
