"""`SchedulerOutput`: one columnar row form, and the views the runner and tests read."""

from __future__ import annotations

import pytest

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput

PARAMS = SamplingParams(temperature=0, max_tokens=4)
SEEDED = SamplingParams(temperature=1.0, max_tokens=4, n=2)


def decode(name: str, token: int, pos: int, table: list[int]) -> ScheduledSequence:
    return ScheduledSequence((name, 0), [token], pos, table, 4, [(name, 0)], PARAMS, 7)


def mixed() -> tuple[SchedulerOutput, list[ScheduledSequence]]:
    """Step order: d0 d1 s0 d2 s1 d3 (d: decode rows, s: prompt chunks)."""
    d = [decode(f"d{i}", 10 + i, 5 + i, [i, 9, 20 + i]) for i in range(4)]
    s0 = ScheduledSequence(("p", 0), [1, 2, 3], 0, [30], 4, [], PARAMS, 0, [2, 3])
    s1 = ScheduledSequence(("q", 0), [4, 5], 6, [31, 32], 4, [("q", 0), ("q", 1)], SEEDED, 3)
    expected = [d[0], d[1], s0, d[2], s1, d[3]]
    out = SchedulerOutput(4)
    for rows in (expected[:4], expected[4:]):  # columns, the targets by index among them
        out.add_rows([r.seq_id for r in rows], [r.token_ids for r in rows],
                     [r.start_pos for r in rows], [r.block_table for r in rows],
                     [len(r.sample_seq_ids) for r in rows], [r.sampling_params for r in rows],
                     [r.seed for r in rows],
                     {i: r.prompt_logprob_token_ids for i, r in enumerate(rows)
                      if r.prompt_logprob_token_ids})  # fmt: skip
    return out, expected


def test_rows_keep_step_order() -> None:
    out, expected = mixed()
    assert out.rows() == expected
    assert out.seq_ids == [s.seq_id for s in expected]
    assert out.num_rows == 6 and out.num_batched_tokens == 4 + 3 + 2
    assert out == SchedulerOutput(4, expected)
    assert out != SchedulerOutput(4, expected[::-1])
    assert out.rows() == expected  # reading changes nothing


def test_runner_views() -> None:
    out, expected = mixed()
    token_ids, positions, slots, tables, seq_lens, query_lens = out.model_inputs()
    assert token_ids == [10, 11, 1, 2, 3, 12, 4, 5, 13]
    assert positions == [5, 6, 0, 1, 2, 7, 6, 7, 8]
    assert slots == [37, 38, 120, 121, 122, 39, 130, 131, 92]
    assert slots == [s for seq in expected for s in seq.slot_mapping]
    assert seq_lens == [6, 7, 3, 8, 8, 9] and query_lens == [1, 1, 3, 1, 2, 1]
    assert tables == [s.block_table for s in expected]
    assert out.sample_rows() == [
        (0, ("d0", 0), PARAMS, 7), (1, ("d1", 0), PARAMS, 7), (5, ("d2", 0), PARAMS, 7),
        (7, ("q", 0), SEEDED, 3), (7, ("q", 1), SEEDED, 3), (8, ("d3", 0), PARAMS, 7),
    ]  # fmt: skip
    assert [(first, s.seq_id) for first, s in out.first_rows()] == [(2, ("p", 0))]


def test_is_empty_and_construction() -> None:
    assert SchedulerOutput(4).is_empty
    assert not SchedulerOutput(4, swap_in=[(0, 1)]).is_empty
    out = SchedulerOutput(4)
    out.add(decode("d", 1, 0, [3]))
    assert not out.is_empty and out.num_batched_tokens == 1
    with pytest.raises(TypeError, match="unexpected"):
        SchedulerOutput(4, seqs=[])


def test_rows_are_checked() -> None:
    out = SchedulerOutput(4)
    with pytest.raises(ValueError, match="params"):
        out.add_rows([("a", 0)], [[1]], [0], [[0]], [1], [None], [0])
    with pytest.raises(ValueError, match="sample_seq_ids"):
        out.add(ScheduledSequence(("a", 0), [1], 0, [0], 4, [("b", 0)], PARAMS))
