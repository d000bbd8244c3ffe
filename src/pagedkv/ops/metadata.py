"""Per-step attention metadata: block tables and lengths as tensors, built once per step."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionPlan:
    """One step's batch checked and split for the layers of one sliding window; made by
    `pagedkv.ops.plan` and used by every layer of the step.

    Attributes:
        cache_shape, dtype: the pools it serves ([num_blocks, block_size, num_kv_heads,
            head_dim]); a layer whose pools differ is refused.
        num_heads: query heads.
        sliding_window: the window, or None.
        run: the backend's `run(query, key_cache, value_cache, state, scale, scales)`.
        state: the backend's own plan (`pagedkv.ops.cpu.CpuPlan` for the CPU backend).
    """

    cache_shape: torch.Size
    dtype: torch.dtype
    num_heads: int
    sliding_window: int | None
    run: Callable[..., torch.Tensor]
    state: Any


@dataclass
class AttentionMetadata:
    """What every layer's attention call needs about the batch, built once per engine step.

    Packed layout: the batch's new tokens sit back to back; sequence s owns query rows
    ``query_start_loc[s] : query_start_loc[s + 1]`` and has ``seq_lens[s]`` tokens in total
    (cached prefix + new), so its new token i sits at position
    ``seq_lens[s] - query_len_s + i``.

    Attributes:
        slot_mapping: int64 [num_tokens], where each new token's K/V row is written
            (slot = block_id * block_size + offset; negative = padding, skipped).
        block_tables: int32 [num_seqs, max_blocks], -1 past each sequence's blocks.
        seq_lens: int32 [num_seqs].
        query_start_loc: int32 [num_seqs + 1], cumulative query lengths from 0.
        max_query_len: largest query length in the batch (None: unknown, as in a plain
            `paged_attention` call, where a GPU backend bounds it without a device sync).
        max_seq_len: largest total length in the batch (None: unknown).
        backend: backend name for `paged_attention` ("auto", "cpu", "reference", "triton").
        plans: per sliding window (None included), the `AttentionPlan` that
            `pagedkv.ops.plan` made for this step, reused by every layer.
        other_groups: the metadata of KV cache groups 1, 2, ... (this one is group 0's):
            the same lengths, their own `block_tables` and `slot_mapping`.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int | None = None
    max_seq_len: int | None = None
    backend: str = "auto"
    plans: dict[int | None, AttentionPlan] = field(default_factory=dict, repr=False, compare=False)
    other_groups: tuple[AttentionMetadata, ...] = field(default=(), repr=False)

    def group(self, index: int) -> AttentionMetadata:
        """The metadata of KV cache group `index` (0: this one)."""
        return self.other_groups[index - 1] if index else self

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """New (query) tokens in the batch."""
        return self.slot_mapping.shape[0]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        slot_mapping: list[int],
        *,
        device: str | torch.device = "cpu",
        backend: str = "auto",
    ) -> AttentionMetadata:
        """Build the tensors from plain lists (one host-to-device copy each).

        Args:
            block_tables: per sequence its physical block ids; ragged, padded here with -1.
            seq_lens: per sequence its total length (cached + new tokens).
            query_lens: per sequence its number of new tokens (>= 0, <= seq_len).
            slot_mapping: per new token its slot, in packed order.
            device: where the tensors live.
            backend: passed through to `paged_attention`.

        Raises:
            ValueError: lengths disagree ("expected X, got Y").
        """
        num_seqs = len(seq_lens)
        if len(block_tables) != num_seqs or len(query_lens) != num_seqs:
            raise ValueError(
                f"block_tables/query_lens: expected {num_seqs} sequences (as seq_lens), "
                f"got {len(block_tables)} and {len(query_lens)}"
            )
        if sum(query_lens) != len(slot_mapping):
            raise ValueError(
                f"slot_mapping: expected sum(query_lens)={sum(query_lens)} slots, "
                f"got {len(slot_mapping)}"
            )
        for s, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if not 0 <= q <= n:
                raise ValueError(f"query_lens[{s}]: expected 0 <= q <= seq_len={n}, got {q}")
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [-1] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                num_seqs, max_blocks
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(
                [0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device
            ),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            backend=backend,
        )
