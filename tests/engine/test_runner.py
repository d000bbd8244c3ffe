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
    """A scheduled chunk of `tokens` at positions start.. (slots follow from `table`)."""
    samples = ([seq_id] if n == 1 else [(seq_id[0], i) for i in range(n)]) if sample else []
    return ScheduledSequence(seq_id, tokens, start, table, BLOCK_SIZE, samples, params, seed)


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
        SchedulerOutput(
            BLOCK_SIZE, [chunk(a, PROMPT_A[:7], 0, TABLE_A), chunk(b, PROMPT_B, 0, TABLE_B, True)]
        )
    )
    assert list(results) == [b]
    got_b = [results[b].token_id]
    assert results[b].logprob == pytest.approx(logprobs_b[0, got_b[0]].item(), abs=2e-3)
    # Step 2: the rest of A's prompt (sampled) and B's first decode.
    results = runner.execute(
        SchedulerOutput(
            BLOCK_SIZE,
            [
                chunk(a, PROMPT_A[7:], 7, TABLE_A, True),
                chunk(b, got_b[-1:], len(PROMPT_B), TABLE_B, True),
            ],
        )
    )
    got_a = [results[a].token_id]
    got_b.append(results[b].token_id)
    # Step 3: one decode each; B's context spills into its second block.
    results = runner.execute(
        SchedulerOutput(
            BLOCK_SIZE,
            [
                chunk(b, got_b[-1:], len(PROMPT_B) + 1, TABLE_B, True),
                chunk(a, got_a[-1:], len(PROMPT_A), TABLE_A, True),
            ],
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
        BLOCK_SIZE,
        [
            chunk(("other", 0), PROMPT_A, 0, TABLE_A, True),
            chunk(("h", 0), PROMPT_B, 0, TABLE_B, True, params=params, seed=1234, n=3),
        ],
    )
    results = engine.runner.execute(step)
    assert [results[("h", i)].token_id for i in range(3)] == expected
    engine.runner.release("h")
    again = engine.runner.execute(step)
    assert [again[("h", i)].token_id for i in range(3)] == expected  # fresh generators


def test_step_without_tokens_moves_blocks_only(model_dir) -> None:
    runner = new_engine(model_dir).runner
    runner.execute(SchedulerOutput(BLOCK_SIZE, [chunk(("a", 0), PROMPT_B, 0, TABLE_B)]))
    key = runner.kv_cache.key_caches[0]
    assert runner.execute(SchedulerOutput(BLOCK_SIZE, copies=[(0, 3)])) == {}
    torch.testing.assert_close(key[3], key[0])
