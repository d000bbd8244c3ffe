"""Simulator policies on small cases worked out by hand, invariants on larger loads, and the
paged replay against a real engine run."""

from __future__ import annotations

import random

import pytest

from pagedkv.config import SchedulerConfig
from pagedkv.sim import paged
from pagedkv.sim.policies import POLICIES, StepCost, create_policy
from pagedkv.sim.simulator import simulate
from pagedkv.sim.workload import Request, make_workload


def run(
    requests,
    name,
    capacity,
    block_size=1,
    max_len=None,
    record=False,
    snapshot_every=1,
    scheduler=None,
    step_cost=None,
):
    policy = create_policy(
        name,
        capacity_tokens=capacity,
        num_blocks=capacity // block_size,
        block_size=block_size,
        max_len=max_len or max(r.total_len for r in requests),
        scheduler=scheduler,
        step_cost=step_cost,
    )
    result = simulate(requests, policy, record=record, snapshot_every=snapshot_every)
    if name.startswith("paged"):
        policy.manager.check()  # everything released, state consistent
        assert policy.manager.num_free_blocks == policy.num_blocks
    return result


def test_single_request_utilization_per_policy():
    # Holds 4, 5, 6, 7 tokens at steps 0..3 (prompt 3 + one token per step), then finishes.
    requests = [Request(0, prompt_len=3, output_len=4)]
    fit = run(requests, "contiguous-first-fit", 64)
    assert (fit.steps, fit.admitted, fit.queued, fit.peak_concurrency) == (4, 1, 0, 1)
    assert fit.mean_kv_utilization == pytest.approx((4 + 5 + 6 + 7) / 7 / 4)
    assert fit.internal_fragmentation == pytest.approx((3 + 2 + 1 + 0) / 4 / 64)
    assert fit.external_fragmentation == 0
    most = run(requests, "contiguous-max", 64, max_len=10)
    assert most.mean_kv_utilization == pytest.approx((4 + 5 + 6 + 7) / 10 / 4)
    # The engine holds the KV of 3, 4, 5, 6 tokens at steps 0..3 (a sampled token's KV is
    # written by the next step): blocks of 4 give 1, 1, 2, 2 blocks.
    paged = run(requests, "paged", 64, block_size=4)
    assert (paged.steps, paged.engine_steps) == (4, 4)
    assert paged.mean_kv_utilization == pytest.approx((3 / 4 + 4 / 4 + 5 / 8 + 6 / 8) / 4)
    assert paged.internal_fragmentation == pytest.approx((1 + 0 + 3 + 2) / 4 / 64)


def test_fifo_head_of_line_blocking():
    # r1 (5 tokens) cannot fit beside r0 (8 of 10); r2 (2 tokens) would, but waits behind r1.
    requests = [Request(0, 5, 3), Request(0, 4, 1), Request(0, 1, 1)]
    result = run(requests, "contiguous-first-fit", 10)
    assert result.steps == 4  # r0 runs steps 0-2, r1 and r2 step 3
    assert (result.admitted, result.queued, result.rejected) == (3, 2, 0)
    assert result.mean_wait_steps == pytest.approx((0 + 3 + 3) / 3)
    assert result.peak_concurrency == 2
    assert result.mean_concurrency == pytest.approx((1 + 1 + 1 + 2) / 4)
    assert result.fragmentation_stalls == 0  # free 2 < 5: plain lack of memory


FRAGMENTING = [
    Request(0, 5, 5),  # a: 10 tokens at [0, 10), steps 0-4
    Request(0, 1, 9),  # b: 10 tokens at [10, 20), steps 0-8
    Request(0, 5, 5),  # c: 10 tokens at [20, 30), steps 0-4
    Request(1, 14, 6),  # d: 20 tokens; from step 5, 20 free in two holes of 10
]


def test_first_fit_stalls_on_fragmented_memory():
    result = run(FRAGMENTING, "contiguous-first-fit", 30)
    assert result.fragmentation_stalls == 4  # steps 5, 6, 7, 8
    assert result.fragmentation_stalled_requests == 1
    assert result.stall_examples == [
        {"step": 5, "request": 3, "need_tokens": 20, "free_tokens": 20, "largest_free_tokens": 10}
    ]
    assert result.steps == 15  # d admitted at step 9, runs 6 steps
    assert result.mean_wait_steps == pytest.approx(8 / 4)


def test_paged_places_the_same_request_at_once():
    # Blocks of 5 (6 blocks): d needs 3 blocks at step 5, when a and c have freed 4.
    result = run(FRAGMENTING, "paged", 30, block_size=5)
    assert result.fragmentation_stalls == 0
    assert result.steps == 11  # d runs steps 5-10
    assert result.peak_concurrency == 3
    assert (result.queued, result.preemptions) == (1, 0)
    assert result.mean_wait_steps == pytest.approx(4 / 4)


def test_contiguous_max_serializes():
    # 20-token slots in 30 tokens: one slot and a 10-token hole nobody can use.
    result = run(FRAGMENTING, "contiguous-max", 30, max_len=20)
    assert result.steps == 25  # a 0-4, b 5-13, c 14-18, d 19-24
    assert result.peak_concurrency == 1
    assert result.fragmentation_stalls == 0  # 10 free < 20 needed


def test_paged_preempts_youngest_and_recomputes():
    # 4 blocks of 2. At step 4 both hold 4 tokens and need a third block: b (youngest) is
    # preempted, a takes the block and ends there (5 outputs, steps 0-4); b comes back at
    # step 5, recomputes its 5 tokens (prompt + 4 outputs) and samples its last output.
    requests = [Request(0, 1, 5), Request(0, 1, 5)]
    steps = []
    policy = create_policy("paged", capacity_tokens=8, num_blocks=4, block_size=2, max_len=6)
    result = paged.replay(requests, policy, on_step=steps.append)
    assert result.preemptions == 1 and result.steps == 6
    assert [s.preempted_request_ids for s in steps] == [[], [], [], [], ["1"], []]
    assert [s.query_lens[0] for s in steps[4:]] == [1, 5]
    assert (result.admitted, result.queued, result.rejected) == (2, 0, 0)


def test_step_cost_sets_the_clock():
    # Step 0 prefills 3 + 5 tokens, steps 1-2 decode 2 tokens: 1 + 8/4, then 1 + 2/4 twice
    # (clock 6); idle until the third arrives at 10; its prefill takes 1 + 2/4.
    requests = [Request(0, 3, 3), Request(0, 5, 3), Request(10, 2, 1)]
    result = run(requests, "paged", 64, block_size=4, step_cost=StepCost(1.0, 0.25), record=True)
    assert result.timeline.steps == [0.0, 3.0, 4.5, 10.0]
    assert result.engine_steps == 4 and result.steps == 12  # 11.5 rounded up
    assert result.mean_wait_steps == 0
    with pytest.raises(ValueError, match="per_token: expected a finite number >= 0"):
        StepCost(1.0, -1.0)
    with pytest.raises(ValueError, match="fixed \\+ per_token > 0"):
        StepCost(0.0, 0.0)


def test_scheduler_limits_apply_to_paged_policies():
    # Two sequences at most and 4 tokens per step: the 10-token prompt takes chunks of 4, 4
    # and 2; request 1's prompt fills the third step; request 2 waits for a free sequence.
    requests = [Request(0, 10, 2), Request(0, 2, 2), Request(0, 2, 2)]
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4)
    steps = []
    policy = create_policy(
        "paged", capacity_tokens=64, num_blocks=16, block_size=4, max_len=12, scheduler=config
    )
    paged.replay(requests, policy, on_step=steps.append)
    ids = [[s.seq_id[0] for s in step.rows()] for step in steps]
    assert ids == [["0"], ["0"], ["0", "1"], ["0", "1"], ["2"], ["2"]]
    assert [len(s.token_ids) for s in steps[2].rows()] == [2, 2]


def test_prefix_sharing_shares_prompt_blocks():
    # Two prompts of 9 tokens whose first 8 (two blocks of 4) are one system prompt.
    requests = [Request(0, 9, 2, prefix_group=0, prefix_len=8) for _ in range(2)]
    paged = run(requests, "paged", 64, block_size=4, record=True)
    shared = run(requests, "paged-prefix", 64, block_size=4, record=True)
    # Step 0: 9 tokens each in 3 blocks; with sharing the 2 prefix blocks are held once.
    assert paged.timeline.reserved[0] == 2 * 3 * 4
    assert shared.timeline.reserved[0] == (2 + 1 + 1) * 4
    assert paged.timeline.held[0] == 18
    assert shared.timeline.held[0] == 18 - 8
    assert shared.manager_stats and paged.steps == shared.steps == 2


def test_rejects_requests_that_can_never_fit():
    requests = [Request(0, 10, 5), Request(0, 30, 5), Request(2, 3, 3)]
    for name in POLICIES:
        # 35 tokens never fit in 32; contiguous-max also rejects 15 > its 12-token slots.
        result = run(requests, name, 32, block_size=4, max_len=12)
        assert result.admitted + result.rejected == len(requests)
        assert result.rejected == (2 if name == "contiguous-max" else 1)
    # contiguous-max with a slot larger than memory rejects everything.
    result = run(requests, "contiguous-max", 32, max_len=40)
    assert (result.admitted, result.rejected) == (0, 3)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("workload", ["sharegpt", "chat"])
def test_paged_waste_is_below_one_block_per_sequence(workload, block_size):
    requests = make_workload(workload, 60, seed=block_size)
    for name in ("paged", "paged-prefix"):
        # No memory-map snapshots (one every 10**9 steps): only per-step totals are checked.
        result = run(requests, name, 12_000, block_size, record=True, snapshot_every=10**9)
        tl = result.timeline
        assert result.admitted + result.rejected == len(requests)
        assert result.fragmentation_stalls == 0
        assert result.preemptions > 0  # the preemption path keeps the totals right too
        for reserved, held, running in zip(tl.reserved, tl.held, tl.running, strict=True):
            assert 0 <= reserved - held <= (block_size - 1) * running


def test_paged_held_tokens_match_block_tables():
    # The aggregate count of held tokens equals the sum over the manager's block tables.
    requests = make_workload("sharegpt", 80, seed=3)
    result = run(requests, "paged", 12_000, block_size=16, record=True)
    tl = result.timeline
    assert len(tl.snapshots) > 100
    held = dict(zip(tl.steps, tl.held, strict=True))
    for step, regions, _ in tl.snapshots:
        assert sum(h for _, _, h in regions) == held[step]


def test_long_context_fragments_contiguous_but_not_paged():
    # llama-3.1-8b in 40 GiB: 327,680 tokens, 2.5 times the workload's 128K request.
    requests = make_workload("long-context", 40, seed=0)
    fit = run(requests, "contiguous-first-fit", 327_680)
    paged = run(requests, "paged", 327_680, block_size=16)
    assert fit.fragmentation_stalls > 0
    ex = fit.stall_examples[0]
    assert ex["largest_free_tokens"] < ex["need_tokens"] <= ex["free_tokens"]
    assert paged.fragmentation_stalls == 0 and paged.external_fragmentation == 0
    assert paged.steps < fit.steps
    for result in (fit, paged):
        assert result.admitted + result.rejected == len(requests) == 40


def test_empty_workload_and_unknown_policy():
    with pytest.raises(ValueError, match="at least one request"):
        simulate(
            [], create_policy("paged", capacity_tokens=16, num_blocks=1, block_size=16, max_len=1)
        )
    with pytest.raises(ValueError, match="policy: expected one of"):
        create_policy("buddy", capacity_tokens=16, num_blocks=1, block_size=16, max_len=1)


def test_paged_replay_schedules_as_a_real_engine_run(tmp_path):
    # The same trace through the simulator and through an engine on a random-weight model:
    # lengths are fixed by ignore_eos + max_tokens, so every step must schedule the same
    # requests and preempt the same ones (chunked prefill, decode-first budget, max_num_seqs,
    # recompute preemption and prefix hits on recomputed tokens all take part).
    from helpers import make_hf_model

    from pagedkv import SamplingParams
    from pagedkv.engine.engine import LLMEngine

    prompt_lens, output_lens = [5, 23, 9, 14, 3, 30, 7], [12, 6, 15, 9, 20, 4, 10]
    block_size, num_blocks, max_num_seqs, max_num_batched_tokens = 4, 12, 4, 16
    requests = [Request(0, p, o) for p, o in zip(prompt_lens, output_lens, strict=True)]
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    simulated = []
    policy = create_policy(
        "paged-prefix",
        capacity_tokens=num_blocks * block_size,
        num_blocks=num_blocks,
        block_size=block_size,
        max_len=64,
        scheduler=config,
    )
    result = paged.replay(requests, policy, on_step=simulated.append)

    engine = LLMEngine.from_engine_args(
        str(make_hf_model(tmp_path, "llama", seed=4)),
        device="cpu",
        dtype="float32",
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=True,
    )
    real, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: real.append(schedule()) or real[-1]
    rng = random.Random(0)
    for index, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        prompt = [rng.randrange(3, 512) for _ in range(p)]
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=o, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()

    def trace(steps):
        return [
            (
                [(s.seq_id[0], s.start_pos, len(s.token_ids)) for s in step.rows()],
                step.preempted_request_ids,
            )
            for step in steps
        ]

    assert trace(simulated) == trace(real)
    assert result.preemptions == engine.scheduler.num_preemptions > 0
    assert result.engine_steps == engine.num_steps
    hits = engine.stats()["prefix_cache_hits"]
    assert result.manager_stats["prefix_cache_hits"] == hits > 0
