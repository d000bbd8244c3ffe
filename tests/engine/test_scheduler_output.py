"""`SchedulerOutput`: compact decode rows and `ScheduledSequence` rows in one step order."""

from __future__ import annotations

import pytest

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput

PARAMS = SamplingParams(temperature=0, max_tokens=4)
SEEDED = SamplingParams(temperature=1.0, max_tokens=4, n=2)


def decode_row(name: str, token: int, pos: int, table: list[int]) -> tuple:
    return ((name, 0), token, pos, table, table[pos // 4] * 4 + pos % 4, PARAMS, 7)


def as_object(row: tuple) -> ScheduledSequence:
    seq_id, token, pos, table, slot, params, seed = row
    return ScheduledSequence(seq_id, [token], pos, table, [slot], [seq_id], params, seed)


def mixed() -> tuple[SchedulerOutput, list[ScheduledSequence]]:
    """Step order: d0 d1 s0 d2 s1 d3 (d: decode rows, s: scheduled rows)."""
    d = [decode_row(f"d{i}", 10 + i, 5 + i, [i, 9, 20 + i]) for i in range(4)]
    s0 = ScheduledSequence(("p", 0), [1, 2, 3], 0, [30], [30 * 4, 121, 122], [], PARAMS, 0)
    s1 = ScheduledSequence(
        ("q", 0), [4, 5], 6, [31, 32], [32 * 4 + 2, 32 * 4 + 3], [("q", 0), ("q", 1)], SEEDED, 3
    )
    out = SchedulerOutput()
    out.decode_rows += d[:2]
    out.add(s0)
    out.decode_rows.append(d[2])
    out.add(s1)
    out.decode_rows.append(d[3])
    expected = [as_object(d[0]), as_object(d[1]), s0, as_object(d[2]), s1, as_object(d[3])]
    return out, expected


def test_rows_keep_step_order_without_changing_the_output() -> None:
    out, expected = mixed()
    assert [(lo, hi, s is None) for lo, hi, s in out.segments()] == [
        (0, 2, False), (2, 3, False), (3, 4, True)
    ]  # fmt: skip
    assert out.rows() == expected
    assert len(out.decode_rows) == 4  # rows() left them compact
    assert out.seq_ids() == [s.seq_id for s in expected]
    assert out.num_rows == 6 and out.num_batched_tokens == 4 + 3 + 2
    assert out == SchedulerOutput(expected)  # either form, the same step
    assert out != SchedulerOutput(expected[::-1])


def test_seqs_turns_decode_rows_into_objects_once() -> None:
    out, expected = mixed()
    seqs = out.seqs
    assert seqs == expected and not out.decode_rows and out.seqs is seqs
    extra = ScheduledSequence(("r", 0), [9], 0, [40], [160], [], PARAMS)
    out.seqs.append(extra)  # the output's own list
    assert out.rows() == [*expected, extra] and out.num_rows == 7


def test_runner_views_match_the_object_form() -> None:
    out, expected = mixed()
    ref = SchedulerOutput(expected)
    assert out.model_inputs() == ref.model_inputs()
    token_ids, positions, slots, tables, seq_lens, query_lens = out.model_inputs()
    assert token_ids == [10, 11, 1, 2, 3, 12, 4, 5, 13]
    assert positions == [5, 6, 0, 1, 2, 7, 6, 7, 8]
    assert slots == [s for seq in expected for s in seq.slot_mapping]
    assert seq_lens == [6, 7, 3, 8, 8, 9] and query_lens == [1, 1, 3, 1, 2, 1]
    assert tables == [s.block_table for s in expected]
    assert out.sample_rows() == ref.sample_rows() == [
        (0, ("d0", 0), PARAMS, 7), (1, ("d1", 0), PARAMS, 7), (5, ("d2", 0), PARAMS, 7),
        (7, ("q", 0), SEEDED, 3), (7, ("q", 1), SEEDED, 3), (8, ("d3", 0), PARAMS, 7),
    ]  # fmt: skip
    assert [(first, s.seq_id) for first, s in out.first_rows()] == [(2, ("p", 0)), (6, ("q", 0))]


def test_is_empty_and_construction() -> None:
    assert SchedulerOutput().is_empty
    assert not SchedulerOutput(swap_in=[(0, 1)]).is_empty
    out = SchedulerOutput()
    out.decode_rows.append(decode_row("d", 1, 0, [3]))
    assert not out.is_empty and out.num_batched_tokens == 1


def test_scheduled_sequence_still_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="slot_mapping"):
        ScheduledSequence(("a", 0), [1, 2], 0, [0], [0], [], PARAMS)
