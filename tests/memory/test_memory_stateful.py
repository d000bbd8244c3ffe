"""Stateful property test: the manager driven like an engine over simulated device/host memory.

Each slot holds the value standing for the KV of its token: the tuple of the sequence's tokens
up to and including it (what attention's KV depends on). The machine applies `pop_copies()`
and swap pairs exactly as an engine would and, after every step, reads every live sequence
back through its block table.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from memory_testing import snapshot

from pagedkv.memory import BlockPool, KVCacheManager, OutOfBlocks
from pagedkv.memory.groups import first_needed_block

PROMPT = st.lists(st.integers(0, 2), min_size=1, max_size=13)  # small vocab: many shared prefixes
# KV cache groups: one full-attention group, or a full and a sliding-window group, or two
# sliding groups of different windows, or sliding groups on both sides of the full one (the
# anchor whose chain the others key under).
WINDOWS = st.sampled_from([(None,), (None, 1), (None, 3), (5, None), (2, 6), (3, None, 1), (3,)])


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 14),
        block_size=st.integers(1, 4),
        num_host_blocks=st.integers(0, 10),
        caching=st.booleans(),
        span_blocks=st.integers(2, 3),
        windows=WINDOWS,
    )
    def setup(self, num_blocks: int, block_size: int, num_host_blocks: int, caching: bool,
              span_blocks: int, windows: tuple[int | None, ...]) -> None:  # fmt: skip
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                                num_host_blocks=num_host_blocks, windows=windows)  # fmt: skip
        if self.m._index is not None:  # short spans, so that these short prompts use them
            self.m._index.span_blocks = span_blocks
        self.bs = block_size
        self.device: list[Any] = [None] * (num_blocks * block_size)
        self.host: list[Any] = [None] * (num_host_blocks * block_size)
        self.tokens: dict[Any, list[int]] = {}  # the engine's own record of each sequence
        self.host_tables: dict[Any, list[int]] = {}  # swapped-out sequences' host blocks
        self.host_values: dict[Any, list[Any]] = {}  # what those host blocks must hold
        self.next_id = 0
        # Block tables `append` handed out, with their contents then: never mutated.
        self.handed: list[tuple[list[int], list[int]]] = []

    # ----- engine-side helpers --------------------------------------------------------------
    def _new_id(self) -> Any:
        self.next_id += 1
        return ("req", self.next_id) if self.next_id % 2 else f"s{self.next_id}"

    def _apply_copies(self) -> None:
        for src, dst in self.m.pop_copies():
            bs = self.bs
            self.device[dst * bs : (dst + 1) * bs] = self.device[src * bs : (src + 1) * bs]

    def _compute(self, seq_id: Any, start: int) -> None:
        """Write the KV of positions start.. of `seq_id` (after pending copies, as the engine)."""
        self._apply_copies()
        toks = self.tokens[seq_id]
        for g in range(self.m.num_groups):
            for pos, slot in zip(range(start, len(toks)),
                                 self.m.slot_mapping(seq_id, start, len(toks), g),
                                 strict=True):  # fmt: skip
                self.device[slot] = tuple(toks[: pos + 1])

    def _readable(self, seq_id: Any, end: int, position: int) -> dict[int, list[Any]]:
        """Per group, the values at the positions before `end` that a token at `position`
        can attend to (all of them in a full-attention group)."""
        out = {}
        for g, window in enumerate(self.m.windows):
            start = first_needed_block(window, position, self.bs) * self.bs
            if window is not None:
                start = max(start, position - window + 1)
            start = min(start, end)
            slots = self.m.slot_mapping(seq_id, start, end, g)
            out[g] = [None] * start + [self.device[s] for s in slots]
        return out

    def _resident(self) -> list[Any]:
        return [s for s in self.tokens if s not in self.host_tables]

    def _expect_unchanged(self, call: Any) -> bool:
        before = snapshot(self.m)
        try:
            call()
        except OutOfBlocks:
            assert snapshot(self.m) == before, "a failed call changed the state"
            return False
        return True

    # ----- rules ----------------------------------------------------------------------------
    @rule(prompt=PROMPT)
    def allocate(self, prompt: list[int]) -> None:
        seq_id, m = self._new_id(), self.m
        num_cached, need, free = m.num_cached_tokens(prompt), m.num_blocks_to_allocate(prompt), \
            m.num_free_blocks  # fmt: skip
        hit: list[int] = []
        if not self._expect_unchanged(lambda: hit.append(m.allocate(seq_id, prompt))):
            assert need > free, f"allocate failed with {need} needed, {free} free"
            return
        assert hit == [num_cached], f"allocate hit {hit}, the query said {num_cached}"
        assert need <= free and m.num_free_blocks == free - need
        self.tokens[seq_id] = list(prompt)
        # Every prefix hit the next token can see points at blocks holding this prompt's values.
        for values in self._readable(seq_id, num_cached, num_cached).values():
            for pos, value in enumerate(values):
                assert value in (None, tuple(prompt[: pos + 1])), f"wrong KV served at {pos}"
        self._compute(seq_id, num_cached)

    @precondition(lambda self: self._resident())
    @rule(data=st.data(), new=PROMPT)
    def append(self, data: st.DataObject, new: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(self._resident()))
        m, start = self.m, len(self.tokens[seq_id])
        need, free = m.num_blocks_to_append(seq_id, len(new)), m.num_free_blocks
        if not self._expect_unchanged(lambda: m.append(seq_id, new)):
            assert need > free
            return
        assert m.num_free_blocks == free - need
        self.tokens[seq_id] += new
        self._compute(seq_id, start)

    @precondition(lambda self: self._resident())
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_one(self, data: st.DataObject, token: int) -> None:
        seq_id = data.draw(st.sampled_from(self._resident()))
        m, start = self.m, len(self.tokens[seq_id])
        need, free, before = m.num_blocks_to_append(seq_id, 1), m.num_free_blocks, snapshot(m)
        try:
            table = m.append(seq_id, [token])
        except OutOfBlocks:
            assert need > free and snapshot(m) == before, "a refused append changed state"
            return
        assert need <= free and m.num_free_blocks == free - need
        assert table == m.block_table(seq_id)
        self.handed.append((table, list(table)))
        self.tokens[seq_id].append(token)
        self._compute(seq_id, start)

    @precondition(lambda self: self._resident())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._resident()))
        child = self._new_id()
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens, key=str)))
        self.m.free(seq_id)
        del self.tokens[seq_id]
        self.host_tables.pop(seq_id, None)
        self.host_values.pop(seq_id, None)

    @precondition(lambda self: self._resident())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self._resident()))
        self._apply_copies()  # copies queued earlier must land before the blocks leave
        pairs: list[tuple[int, int]] = []
        if self._expect_unchanged(lambda: pairs.extend(self.m.swap_out(seq_id))):
            bs = self.bs
            for dev, hst in pairs:
                self.host[hst * bs : (hst + 1) * bs] = self.device[dev * bs : (dev + 1) * bs]
            self.host_tables[seq_id] = [hst for _, hst in pairs]
            self.host_values[seq_id] = [self.host[h * bs : (h + 1) * bs] for _, h in pairs]

    @precondition(lambda self: self.host_tables)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.host_tables, key=str)))
        self._apply_copies()
        pairs: list[tuple[int, int]] = []
        if self._expect_unchanged(lambda: pairs.extend(self.m.swap_in(seq_id))):
            assert [hst for hst, _ in pairs] == self.host_tables.pop(seq_id)
            del self.host_values[seq_id]
            bs = self.bs
            for hst, dev in pairs:
                self.device[dev * bs : (dev + 1) * bs] = self.host[hst * bs : (hst + 1) * bs]

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = self.m.num_free_blocks == self.m.num_blocks
        assert self.m.reset_prefix_cache() == idle
        if idle:
            assert self.m.stats()["num_cached_blocks"] == 0

    # ----- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check()
        for table, contents in self.handed:
            assert table == contents, "a block table handed out was mutated"
        self._apply_copies()
        bs = self.bs
        for seq_id, toks in self.tokens.items():
            if seq_id in self.host_tables:
                values = [self.host[h * bs : (h + 1) * bs] for h in self.host_tables[seq_id]]
                assert values == self.host_values[seq_id], f"{seq_id!r}'s host blocks changed"
                continue
            assert self.m.num_tokens(seq_id) == len(toks)
            # The next token sits at len(toks): everything it can attend to must be intact.
            for values in self._readable(seq_id, len(toks), len(toks)).values():
                assert values[: len(toks)] == [
                    tuple(toks[: p + 1]) if v is not None else None for p, v in enumerate(values)
                ], f"{seq_id!r} reads back another sequence's KV"

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for seq_id in list(self.tokens):
            self.m.free(seq_id)
        self.m.check()
        assert self.m.num_free_blocks == self.m.num_blocks
        assert self.m.num_free_host_blocks == self.m.num_host_blocks


class CompactingMachine(ManagerMachine):
    """The same machine with the cached queue compacted on every call."""

    def __init__(self) -> None:
        super().__init__()
        BlockPool.compact_slack = 0

    def teardown(self) -> None:
        BlockPool.compact_slack = DEFAULT_SLACK
        super().teardown()


DEFAULT_SLACK = BlockPool.compact_slack
FAST = settings(max_examples=100, stateful_step_count=40, deadline=None)
CompactingMachine.TestCase.settings = FAST
TestCompactingMachine = CompactingMachine.TestCase

ManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerMachine = ManagerMachine.TestCase
