"""Simulator policies on small cases worked out by hand, plus invariants on larger loads."""

from __future__ import annotations

import pytest

from pagedkv.sim.policies import POLICIES, create_policy
from pagedkv.sim.simulator import simulate
from pagedkv.sim.workload import Request, make_workload


def run(requests, name, capacity, block_size=1, max_len=None, record=False, snapshot_every=1):
    policy = create_policy(
        name,
        capacity_tokens=capacity,
        num_blocks=capacity // block_size,
        block_size=block_size,
        max_len=max_len or max(r.total_len for r in requests),
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
    # Blocks of 4: 1, 2, 2, 2 blocks for 4, 5, 6, 7 tokens.
    paged = run(requests, "paged", 64, block_size=4)
    assert paged.steps == 4
    assert paged.mean_kv_utilization == pytest.approx((4 / 4 + 5 / 8 + 6 / 8 + 7 / 8) / 4)
    assert paged.internal_fragmentation == pytest.approx((0 + 3 + 2 + 1) / 4 / 64)


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
    # 4 blocks of 2. Both need a third block at step 3: b (youngest) is preempted with 4
    # tokens, a finishes at step 4, b comes back at step 5 with a 4-token prompt.
    requests = [Request(0, 1, 5), Request(0, 1, 5)]
    result = run(requests, "paged", 8, block_size=2)
    assert result.preemptions == 1
    assert result.steps == 7
    assert (result.admitted, result.queued, result.rejected) == (2, 0, 0)


def test_prefix_sharing_shares_prompt_blocks():
    # Two prompts of 9 tokens whose first 8 (two blocks of 4) are one system prompt.
    requests = [Request(0, 9, 2, prefix_group=0, prefix_len=8) for _ in range(2)]
    paged = run(requests, "paged", 64, block_size=4, record=True)
    shared = run(requests, "paged-prefix", 64, block_size=4, record=True)
    # Step 0: 10 tokens each in 3 blocks; with sharing the 2 prefix blocks are held once.
    assert paged.timeline.reserved[0] == 2 * 3 * 4
    assert shared.timeline.reserved[0] == (2 + 1 + 1) * 4
    assert paged.timeline.held[0] == 20
    assert shared.timeline.held[0] == 20 - 8
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


def test_seed_scenario_fragments_contiguous_but_not_paged():
    # llama-3.1-8b in 40 GiB: 327,680 tokens, 2.5 times the seed's 128K request.
    requests = make_workload("seed", 60, seed=0)
    fit = run(requests, "contiguous-first-fit", 327_680)
    paged = run(requests, "paged", 327_680, block_size=16)
    assert fit.fragmentation_stalls > 0
    ex = fit.stall_examples[0]
    assert ex["largest_free_tokens"] < ex["need_tokens"] <= ex["free_tokens"]
    assert paged.fragmentation_stalls == 0 and paged.external_fragmentation == 0
    assert paged.steps < fit.steps
    for result in (fit, paged):
        assert result.admitted + result.rejected == len(requests) == 60


def test_empty_workload_and_unknown_policy():
    with pytest.raises(ValueError, match="at least one request"):
        simulate(
            [], create_policy("paged", capacity_tokens=16, num_blocks=1, block_size=16, max_len=1)
        )
    with pytest.raises(ValueError, match="policy: expected one of"):
        create_policy("buddy", capacity_tokens=16, num_blocks=1, block_size=16, max_len=1)
