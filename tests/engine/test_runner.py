"""`ModelRunner.execute(step)` on hand-built `SchedulerOutput`s: the step alone drives it."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model
from test_engine_hf import MARGIN, hf_greedy

from pagedkv import SamplingParams
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
PROMPT_A = [17, 200, 31, 4, 99, 150, 8, 77, 301, 12, 45]  # 11 tokens: two chunks
PROMPT_B = [5, 400, 23, 61, 90, 7]
TABLE_A = [5, 2, 9]  # hand-picked, out of order and interleaved with B's
TABLE_B = [0, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("runner"), "llama", seed=1)


def new_engine(model_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(
        str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=16
    )


def chunk(seq_id, tokens, start, table, sample=False, params=GREEDY, seed=0, n=1):
    """A scheduled chunk of `tokens` at positions start.., slots computed from `table`."""
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for p in range(start, start + len(tokens))
    ]
    samples = [(seq_id[0], i) for i in range(n)] if sample else []
    return ScheduledSequence(seq_id, tokens, start, table, slots, samples, params, seed)


def test_hand_built_steps_match_transformers_greedy(model_dir) -> None:
    (expected_a, logits_a), (expected_b, logits_b) = hf_greedy(model_dir, [PROMPT_A, PROMPT_B])
    for logits in (logits_a[:2], logits_b[:3]):
        top2 = logits.topk(2, dim=-1).values
        assert bool((top2[:, 0] - top2[:, 1] > MARGIN).all()), "a near-tie: pick another seed"
    logprobs_a, logprobs_b = logits_a.log_softmax(-1), logits_b.log_softmax(-1)
    runner = new_engine(model_dir).runner
    a, b = ("a", 0), ("b", 0)
    # Step 1: A's first chunk (no sample) next to B's whole prompt.
    results = runner.execute(
        SchedulerOutput([chunk(a, PROMPT_A[:7], 0, TABLE_A), chunk(b, PROMPT_B, 0, TABLE_B, True)])
    )
    assert list(results) == [b]
    got_b = [results[b].token_id]
    assert results[b].logprob == pytest.approx(logprobs_b[0, got_b[0]].item(), abs=2e-3)
    # Step 2: the rest of A's prompt (sampled) and B's first decode.
    results = runner.execute(
        SchedulerOutput(
            [
                chunk(a, PROMPT_A[7:], 7, TABLE_A, True),
                chunk(b, got_b[-1:], len(PROMPT_B), TABLE_B, True),
            ]
        )
    )
    got_a = [results[a].token_id]
    got_b.append(results[b].token_id)
    # Step 3: one decode each; B's context spills into its second block.
    results = runner.execute(
        SchedulerOutput(
            [
                chunk(b, got_b[-1:], len(PROMPT_B) + 1, TABLE_B, True),
                chunk(a, got_a[-1:], len(PROMPT_A), TABLE_A, True),
            ]
        )
    )
    got_a.append(results[a].token_id)
    got_b.append(results[b].token_id)
    assert got_a == expected_a[:2] and got_b == expected_b[:3]
    assert results[a].logprob == pytest.approx(logprobs_a[1, got_a[1]].item(), abs=2e-3)


def test_seeded_samples_match_a_full_engine_run(model_dir) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=1, ignore_eos=True)
    engine = new_engine(model_dir)
    engine.add_request("ref", PROMPT_B, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    expected = [c.token_ids[0] for c in outputs[-1].outputs]
    # The same prompt, params and seed in a hand-built step, beside an unrelated greedy one.
    step = SchedulerOutput(
        [
            chunk(("other", 0), PROMPT_A, 0, TABLE_A, True),
            chunk(("h", 0), PROMPT_B, 0, TABLE_B, True, params=params, seed=1234, n=3),
        ]
    )
    results = engine.runner.execute(step)
    assert [results[("h", i)].token_id for i in range(3)] == expected
    engine.runner.release("h")
    again = engine.runner.execute(step)
    assert [again[("h", i)].token_id for i in range(3)] == expected  # fresh generators


def test_step_without_tokens_moves_blocks_only(model_dir) -> None:
    runner = new_engine(model_dir).runner
    runner.execute(SchedulerOutput([chunk(("a", 0), PROMPT_B, 0, TABLE_B)]))
    key = runner.kv_cache.key_caches[0]
    assert runner.execute(SchedulerOutput(copies=[(0, 3)])) == {}
    torch.testing.assert_close(key[3], key[0])


def test_scheduled_sequence_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="slot_mapping: expected 2 slots"):
        ScheduledSequence(("a", 0), [1, 2], 0, [0], [0])
    with pytest.raises(ValueError, match="sampling_params"):
        ScheduledSequence(("a", 0), [1], 0, [0], [0], [("a", 0)])


def test_decode_rows_run_as_the_same_rows_as_objects(model_dir) -> None:
    """A step whose plain decodes are compact `DecodeRow`s (between and after other rows)
    samples exactly what the same step made of `ScheduledSequence`s samples."""
    prompt_c, table_c = [3, 8, 14], [11]
    a, b, c = ("a", 0), ("b", 0), ("c", 0)
    first = [
        chunk(a, PROMPT_A[:7], 0, TABLE_A),
        chunk(b, PROMPT_B, 0, TABLE_B, True),
        chunk(c, prompt_c, 0, table_c, True),
    ]
    results = []
    for compact in (True, False):
        runner = new_engine(model_dir).runner
        tokens = runner.execute(SchedulerOutput(list(first)))
        decodes = [
            (seq_id, tokens[seq_id].token_id, len(prompt), table, table[len(prompt) // 4] * 4
             + len(prompt) % 4, GREEDY, 0)
            for seq_id, prompt, table in ((b, PROMPT_B, TABLE_B), (c, prompt_c, table_c))
        ]  # fmt: skip
        step = SchedulerOutput()
        if compact:
            step.decode_rows.append(decodes[0])
            step.add(chunk(a, PROMPT_A[7:], 7, TABLE_A, True))
            step.decode_rows.append(decodes[1])
            assert [s.seq_id for s in step.rows()] == [b, a, c]
        else:
            step.add(chunk(b, [decodes[0][1]], len(PROMPT_B), TABLE_B, True))
            step.add(chunk(a, PROMPT_A[7:], 7, TABLE_A, True))
            step.add(chunk(c, [decodes[1][1]], len(prompt_c), table_c, True))
        out = runner.execute(step)
        results.append({k: (r.token_id, r.logprob) for k, r in out.items()})
    assert results[0] == results[1]
    assert set(results[0]) == {a, b, c}
