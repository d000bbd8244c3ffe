"""What one `Scheduler.schedule()` hands the runner: everything the step needs, as plain data.

Token ids, positions, slots, block tables and, for the rows that sample, their
`SamplingParams` and seed: the runner needs nothing else (no live `Request`). Standard
library only, never tensors: the simulator consumes the same objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat

from pagedkv.engine.request import SeqId
from pagedkv.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """Tokens of one sequence computed in this step.

    `token_ids` sit at positions `start_pos .. start_pos + len(token_ids) - 1`; their KV is
    written to `slot_mapping` (one slot per token, `block_id * block_size + offset`) and
    attention reads the whole context through `block_table`. When `sample_seq_ids` is not
    empty, the last row's logits are sampled once for each id in it (more than one only for
    the fork of n > 1) with `sampling_params`; sample `(request_id, index)` draws from the
    generator of `(seed, index)`. `prompt_logprob_token_ids[i]` is the prompt token after
    row i: the runner returns its logprob (and the top `sampling_params.prompt_logprobs`)
    from row i's logits; empty unless the request asks for prompt logprobs. `block_table` may
    be the very list a later step hands out again (replaced, not changed, when the blocks
    change): read it, never mutate it.

    Raises:
        ValueError: `slot_mapping` does not have one slot per token, or a sampling
            sequence has no `sampling_params`.
    """

    seq_id: SeqId
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot_mapping: list[int]
    sample_seq_ids: list[SeqId] = field(default_factory=list)
    sampling_params: SamplingParams | None = None
    seed: int = 0
    prompt_logprob_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.slot_mapping) != len(self.token_ids):
            raise ValueError(
                f"slot_mapping: expected {len(self.token_ids)} slots (one per token), "
                f"got {len(self.slot_mapping)}"
            )
        if self.sample_seq_ids and self.sampling_params is None:
            raise ValueError(
                f"sampling_params: expected SamplingParams for {self.seq_id!r}, which samples, "
                "got None"
            )
        if len(self.prompt_logprob_token_ids) > len(self.token_ids):
            raise ValueError(
                f"prompt_logprob_token_ids: expected at most one per token "
                f"({len(self.token_ids)}), got {len(self.prompt_logprob_token_ids)}"
            )

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached tokens plus the new ones)."""
        return self.start_pos + len(self.token_ids)


# A plain decode row: (seq_id, token_id, position, block_table, slot, sampling_params, seed).
# It samples its last (only) row once for seq_id and takes no prompt logprobs.
DecodeRow = tuple[SeqId, int, int, list[int], int, SamplingParams, int]


class SchedulerOutput:
    """One step's work for the runner. Apply `swap_out`, then `swap_in`, then `copies`
    to the KV tensors before the forward pass.

    The step's rows come in two forms, in one order::

        decode_rows   [d0 d1 d2 | d3 d4 ...]      compact tuples (`DecodeRow`), one per plain
        scheduled          [s0]  [s1]             decode; `ScheduledSequence` for the rest
        rows_before         3     5               decode rows ahead of each scheduled row

    Step order: d0 d1 d2 s0 d3 d4 s1 (and any decode rows after the last scheduled one).
    The plain decodes of a large batch cost a tuple each instead of an object and three
    lists; `segments()` walks both forms in step order, and `seqs` gives every row as a
    `ScheduledSequence` (turning the decode rows into objects, once, on first access).
    """

    __slots__ = ("decode_rows", "scheduled", "rows_before", "copies", "swap_out", "swap_in",
                 "preempted_request_ids", "finished_request_ids")  # fmt: skip

    def __init__(
        self,
        seqs: list[ScheduledSequence] | None = None,
        copies: list[tuple[int, int]] | None = None,
        swap_out: list[tuple[int, int]] | None = None,
        swap_in: list[tuple[int, int]] | None = None,
        preempted_request_ids: list[str] | None = None,
        finished_request_ids: list[str] | None = None,
    ) -> None:
        """Args: the fields of the same names; `seqs` become the `scheduled` rows (no
        decode rows), the others default to empty lists."""
        self.decode_rows: list[DecodeRow] = []
        self.scheduled: list[ScheduledSequence] = [] if seqs is None else seqs
        self.rows_before: list[int] = [0] * len(self.scheduled)
        self.copies = [] if copies is None else copies  # (src, dst) device blocks
        self.swap_out = [] if swap_out is None else swap_out  # (device, host)
        self.swap_in = [] if swap_in is None else swap_in  # (host, device)
        self.preempted_request_ids = [] if preempted_request_ids is None else preempted_request_ids
        # Requests that ended inside schedule() (no room to grow even alone in the pool).
        self.finished_request_ids = [] if finished_request_ids is None else finished_request_ids

    def add(self, seq: ScheduledSequence) -> None:
        """Append a row in `ScheduledSequence` form (after every decode row so far)."""
        self.scheduled.append(seq)
        self.rows_before.append(len(self.decode_rows))

    def segments(self) -> Iterator[tuple[int, int, ScheduledSequence | None]]:
        """The rows in step order: ``decode_rows[lo:hi]``, then one scheduled row (None
        after the last)."""
        lo, num_decodes = 0, len(self.decode_rows)
        # A row appended to `scheduled` itself (not through `add`) follows every decode row.
        before = chain(self.rows_before, repeat(num_decodes))
        for hi, seq in zip(before, self.scheduled, strict=False):
            yield lo, hi, seq
            lo = hi
        yield lo, num_decodes, None

    def rows(self) -> list[ScheduledSequence]:
        """Every row as a `ScheduledSequence`, in step order (new objects for the decode
        rows; nothing changes here)."""
        rows: list[ScheduledSequence] = []
        decode_rows = self.decode_rows
        for lo, hi, seq in self.segments():
            rows += [
                ScheduledSequence(
                    seq_id, [token], pos, table, [slot], [seq_id], params, seed, []
                )
                for seq_id, token, pos, table, slot, params, seed in decode_rows[lo:hi]
            ]  # fmt: skip
            if seq is not None:
                rows.append(seq)
        return rows

    @property
    def seqs(self) -> list[ScheduledSequence]:
        """Every row as a `ScheduledSequence`, in step order: the decode rows become
        scheduled rows here, so the list returned is the output's own (appending to it
        adds a row)."""
        if self.decode_rows:
            self.scheduled = self.rows()
            self.decode_rows, self.rows_before = [], [0] * len(self.scheduled)
        return self.scheduled

    def seq_ids(self) -> list[SeqId]:
        """Each row's sequence id, in step order."""
        ids: list[SeqId] = []
        for lo, hi, seq in self.segments():
            ids += [row[0] for row in self.decode_rows[lo:hi]]
            if seq is not None:
                ids.append(seq.seq_id)
        return ids

    def model_inputs(
        self,
    ) -> tuple[list[int], list[int], list[int], list[list[int]], list[int], list[int]]:
        """The forward pass's inputs, in step order.

        Returns:
            ``(token_ids, positions, slot_mapping)``, one entry per token, and
            ``(block_tables, seq_lens, query_lens)``, one per row.
        """
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        for lo, hi, seq in self.segments():
            if hi > lo:  # columns of the decode rows, cut in C
                columns = zip(*self.decode_rows[lo:hi], strict=True)
                _, tokens, starts, blocks, row_slots, _, _ = columns
                token_ids += tokens
                positions += starts
                slots += row_slots
                tables += blocks
                seq_lens += [start + 1 for start in starts]
                query_lens += [1] * (hi - lo)
            if seq is not None:
                token_ids += seq.token_ids
                positions += range(seq.start_pos, seq.seq_len)
                slots += seq.slot_mapping
                tables.append(seq.block_table)
                seq_lens.append(seq.seq_len)
                query_lens.append(len(seq.token_ids))
        return token_ids, positions, slots, tables, seq_lens, query_lens

    def sample_rows(self) -> list[tuple[int, SeqId, SamplingParams, int]]:
        """Per sample, in step order: ``(token index of the row it samples, seq id,
        sampling_params, seed)`` (an n > 1 fork samples the same row n times)."""
        samples: list[tuple[int, SeqId, SamplingParams, int]] = []
        end = 0
        for lo, hi, seq in self.segments():
            samples += [
                (end + i, row[0], row[5], row[6]) for i, row in enumerate(self.decode_rows[lo:hi])
            ]
            end += hi - lo
            if seq is not None:
                end += len(seq.token_ids)
                for seq_id in seq.sample_seq_ids:
                    assert seq.sampling_params is not None, "checked by ScheduledSequence"
                    samples.append((end - 1, seq_id, seq.sampling_params, seq.seed))
        return samples

    def first_rows(self) -> list[tuple[int, ScheduledSequence]]:
        """Each scheduled row (not the decode rows) with the token index of its first
        token in step order."""
        out: list[tuple[int, ScheduledSequence]] = []
        first = 0
        for lo, hi, seq in self.segments():
            first += hi - lo
            if seq is not None:
                out.append((first, seq))
                first += len(seq.token_ids)
        return out

    @property
    def num_rows(self) -> int:
        """Sequences computed in this step."""
        return len(self.decode_rows) + len(self.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode_rows) + sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.num_rows and not self.swap_out and not self.swap_in

    def _fields(self) -> dict[str, object]:
        return dict(seqs=self.rows(), copies=self.copies, swap_out=self.swap_out,
                    swap_in=self.swap_in, preempted_request_ids=self.preempted_request_ids,
                    finished_request_ids=self.finished_request_ids)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        """Equal when the rows (in either form) and every other field are."""
        if not isinstance(other, SchedulerOutput):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self._fields().items())
        return f"SchedulerOutput({fields})"
