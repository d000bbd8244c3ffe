"""What one `Scheduler.schedule()` hands the runner: everything the step needs, as plain data.

Token ids, positions, block tables and, for the rows that sample, their `SamplingParams`
and seed: the runner needs nothing else (no live `Request`). Standard library only, never
tensors: the simulator consumes the same objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any

from pagedkv.engine.request import SeqId
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.memory.sequence import slots_of


@dataclass(slots=True)
class ScheduledSequence:
    """One row of a step, as `SchedulerOutput.rows()` shows it: tokens of one sequence.

    `token_ids` sit at positions `start_pos .. start_pos + len(token_ids) - 1`; their KV is
    written to `slot_mapping` (``block_table[p // block_size] * block_size + p % block_size``)
    and attention reads the whole context through `block_table`. When `sample_seq_ids` is
    not empty, the last row's logits are sampled once for each id in it (more than one only
    for the fork of n > 1) with `sampling_params`; sample `(request_id, index)` draws from
    the generator of `(seed, index)`. `prompt_logprob_token_ids[i]` is the prompt token
    after row i: the runner returns its logprob (and the top
    `sampling_params.prompt_logprobs`) from row i's logits.
    """

    seq_id: SeqId
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    block_size: int
    sample_seq_ids: list[SeqId] = field(default_factory=list)
    sampling_params: SamplingParams | None = None
    seed: int = 0
    prompt_logprob_token_ids: list[int] = field(default_factory=list)
    # KV cache groups whose blocks `block_table` interleaves (`KVCacheManager.block_table`).
    num_groups: int = 1

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached tokens plus the new ones)."""
        return self.start_pos + len(self.token_ids)

    @property
    def slot_mapping(self) -> list[int]:
        """The first KV cache group's slots of the row's tokens."""
        return slots_of(
            self.block_table, self.block_size, self.start_pos, self.seq_len, self.num_groups
        )


def sample_ids(seq_id: SeqId, num_samples: int) -> list[SeqId]:
    """The samples a row takes: none, its own sequence, or (the prompt's last row before
    the fork of n > 1) samples 0..n-1 of its request."""
    if num_samples == 1:
        return [seq_id]
    return [(seq_id[0], i) for i in range(num_samples)]


class SchedulerOutput:
    """One step's work for the runner, one entry per row in each row column, in step order.
    Apply `swap_out`, then `swap_in`, then `copies` to the KV tensors before the forward
    pass.

    Row columns: `seq_ids`, `start_pos`, `query_lens` (tokens computed), `block_tables`,
    `num_samples` (0, 1, or n for the row that samples all n of an unforked request),
    `params`, `seeds`; `token_ids` holds every row's tokens back to back; rows asking for
    prompt logprobs have their targets in `prompt_logprob_targets` (row -> tokens). A block
    table may be the very list a later step hands out again (replaced, not changed, when the
    blocks change): read it, never mutate it. Slots are computed from the tables. With
    `num_groups` KV cache groups a table interleaves their blocks (entry ``i * G + g`` is
    group g's block i).
    """

    __slots__ = ("block_size", "num_groups", "seq_ids", "start_pos", "query_lens", "block_tables",
                 "token_ids", "num_samples", "params", "seeds", "prompt_logprob_targets",
                 "copies", "swap_out", "swap_in", "preempted_request_ids",
                 "finished_request_ids")  # fmt: skip

    def __init__(
        self, block_size: int, rows: Iterable[ScheduledSequence] = (), **lists: Any
    ) -> None:
        """Args: `block_size` of the tables; `rows` added in order (see `add`); keywords
        `copies`, `swap_out`, `swap_in`, `preempted_request_ids`, `finished_request_ids`
        (default empty), `num_groups` (default 1)."""
        self.block_size = block_size
        self.num_groups: int = lists.pop("num_groups", 1)
        self.seq_ids: list[SeqId] = []
        self.start_pos: list[int] = []
        self.query_lens: list[int] = []
        self.block_tables: list[list[int]] = []
        self.token_ids: list[int] = []
        self.num_samples: list[int] = []
        self.params: list[SamplingParams | None] = []
        self.seeds: list[int] = []
        self.prompt_logprob_targets: dict[int, list[int]] = {}
        self.copies: list[tuple[int, int]] = lists.pop("copies", [])  # (src, dst) device
        self.swap_out: list[tuple[int, int]] = lists.pop("swap_out", [])  # (device, host)
        self.swap_in: list[tuple[int, int]] = lists.pop("swap_in", [])  # (host, device)
        self.preempted_request_ids: list[str] = lists.pop("preempted_request_ids", [])
        # Requests that ended inside schedule() (no room to grow even alone in the pool).
        self.finished_request_ids: list[str] = lists.pop("finished_request_ids", [])
        if lists:
            raise TypeError(f"SchedulerOutput: unexpected keywords {sorted(lists)}")
        for row in rows:
            self.add(row)

    def add_rows(self, seq_ids: list[SeqId], token_ids: list[list[int]], start_pos: list[int],
                 block_tables: list[list[int]], num_samples: list[int],
                 params: list[SamplingParams | None], seeds: list[int],
                 prompt_logprob_targets: dict[int, list[int]] | None = None) -> None:  # fmt: skip
        """Append rows, one per entry of each list (the columns' meaning is in the class
        docstring; `token_ids` holds each row's tokens, `prompt_logprob_targets` the
        non-empty targets by index in these lists)."""
        # all(): truth tests in C (`None in params` would call each one's __eq__).
        rows = () if all(params) else zip(seq_ids, num_samples, params, strict=True)
        for seq_id, num, row_params in rows:  # a row without params must not sample
            if num and row_params is None:
                raise ValueError(f"params: expected SamplingParams for {seq_id!r}, which samples")
        first = len(self.seq_ids)
        for i, targets in (prompt_logprob_targets or {}).items():
            self.prompt_logprob_targets[first + i] = targets
        self.seq_ids += seq_ids
        self.start_pos += start_pos
        self.query_lens += map(len, token_ids)
        self.block_tables += block_tables
        self.token_ids += chain.from_iterable(token_ids)
        self.num_samples += num_samples
        self.params += params
        self.seeds += seeds

    def add(self, row: ScheduledSequence) -> None:
        """Append a row given as a `ScheduledSequence` (its `sample_seq_ids` must be one of
        the forms `sample_ids` makes)."""
        num = len(row.sample_seq_ids)
        if row.sample_seq_ids != (sample_ids(row.seq_id, num) if num else []):
            raise ValueError(
                f"sample_seq_ids: expected {row.seq_id!r}'s own, got {row.sample_seq_ids}"
            )
        targets = {0: row.prompt_logprob_token_ids} if row.prompt_logprob_token_ids else None
        self.add_rows([row.seq_id], [row.token_ids], [row.start_pos], [row.block_table], [num],
                      [row.sampling_params], [row.seed], targets)  # fmt: skip

    def _token_starts(self) -> list[int]:
        """Each row's first token index in `token_ids`."""
        return list(accumulate(self.query_lens, initial=0))[:-1]

    def row(self, index: int, first: int) -> ScheduledSequence:
        """Row `index` (whose first token is `token_ids[first]`) as a `ScheduledSequence`."""
        seq_id, num = self.seq_ids[index], self.num_samples[index]
        return ScheduledSequence(
            seq_id,
            self.token_ids[first : first + self.query_lens[index]],
            self.start_pos[index],
            self.block_tables[index],
            self.block_size,
            sample_ids(seq_id, num) if num else [],
            self.params[index],
            self.seeds[index],
            self.prompt_logprob_targets.get(index, []),
            self.num_groups,
        )

    def rows(self) -> list[ScheduledSequence]:
        """Every row as a new `ScheduledSequence`, in step order."""
        return [self.row(i, first) for i, first in enumerate(self._token_starts())]

    def first_rows(self) -> list[tuple[int, ScheduledSequence]]:
        """The rows that ask for prompt logprobs, each with its first token's index."""
        starts = self._token_starts()
        return [(starts[i], self.row(i, starts[i])) for i in self.prompt_logprob_targets]

    def model_inputs(
        self,
    ) -> tuple[list[int], list[int], list[int], list[list[int]], list[int], list[int]]:
        """The forward pass's inputs, in step order.

        Returns:
            ``(token_ids, positions, slot_mapping)``, one entry per token, and
            ``(block_tables, seq_lens, query_lens)``, one per row; the slots and tables are
            the first KV cache group's (`group_inputs` gives the others').
        """
        positions, seq_lens = [], []
        for start, num in zip(self.start_pos, self.query_lens, strict=True):
            if num == 1:
                positions.append(start)
            else:
                positions += range(start, start + num)
            seq_lens.append(start + num)
        slots, tables = self.group_inputs(0)
        return list(self.token_ids), positions, slots, tables, seq_lens, list(self.query_lens)

    def group_inputs(self, group: int) -> tuple[list[int], list[list[int]]]:
        """KV cache group `group`'s ``slot_mapping`` (one per token) and block tables (one
        per row)."""
        bs, num_groups, slots = self.block_size, self.num_groups, []
        for start, num, table in zip(
            self.start_pos, self.query_lens, self.block_tables, strict=True
        ):
            if num == 1:
                slots.append(table[start // bs * num_groups + group] * bs + start % bs)
            else:
                slots += slots_of(table, bs, start, start + num, num_groups, group)
        if num_groups == 1:
            return slots, list(self.block_tables)
        return slots, [table[group::num_groups] for table in self.block_tables]

    def sample_rows(self) -> list[tuple[int, SeqId, SamplingParams, int]]:
        """Per sample, in step order: ``(token index of the row it samples, seq id,
        sampling_params, seed)`` (an n > 1 fork samples the same row n times)."""
        samples: list[tuple[int, SeqId, SamplingParams, int]] = []
        end = -1
        for seq_id, num, count, params, seed in zip(
            self.seq_ids, self.query_lens, self.num_samples, self.params, self.seeds, strict=True
        ):
            end += num
            if count == 1:
                samples.append((end, seq_id, params, seed))  # type: ignore[arg-type]
            elif count:
                samples += [(end, s, params, seed) for s in sample_ids(seq_id, count)]  # type: ignore[misc]
        return samples

    @property
    def num_rows(self) -> int:
        """Sequences computed in this step."""
        return len(self.seq_ids)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids and not self.swap_out and not self.swap_in

    def _fields(self) -> dict[str, object]:
        return dict(rows=self.rows(), num_groups=self.num_groups, copies=self.copies,
                    swap_out=self.swap_out, swap_in=self.swap_in,
                    preempted_request_ids=self.preempted_request_ids,
                    finished_request_ids=self.finished_request_ids)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        """Equal when the rows and every other field are."""
        if not isinstance(other, SchedulerOutput):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self._fields().items())
        return f"SchedulerOutput({fields})"
