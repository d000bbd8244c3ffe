"""The stand-in's token ids: the runner samples what `token_ids` gives, and a smaller
`id_shift` (int32 ids) changes no scheduling decision."""

from __future__ import annotations

import pytest

from pagedkv.config import SchedulerConfig
from pagedkv.engine.request import Request as EngineRequest
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from pagedkv.memory import KVCacheManager
from pagedkv.sim.paged import StandInRunner, token_ids
from pagedkv.sim.policies import StepCost
from pagedkv.sim.workload import Request


@pytest.mark.parametrize("id_shift", [32, 9])
def test_runner_samples_the_workload_token(id_shift: int) -> None:
    request = Request(arrival=0.0, prompt_len=6, output_len=4, prefix_group=1, prefix_len=4)
    prompt = token_ids(3, request, 0, 6, id_shift=id_shift)
    row = ScheduledSequence(("3", 0), prompt, 0, [0], 8, [("3", 0)], SamplingParams(), 0, [])
    step = SchedulerOutput(8, [row])
    sampled = StandInRunner(StepCost(), id_shift=id_shift).execute(step)
    assert sampled == {("3", 0): token_ids(3, request, 6, 7, id_shift=id_shift)[0]}
    # Shared prefix ids, then the request's own: all distinct from another request's.
    other = token_ids(4, request, 0, 10, id_shift=id_shift)
    assert prompt[:4] == other[:4]
    assert not set(prompt[4:]) & set(other)


def _trace(id_shift: int) -> list[tuple]:
    """Every step's rows (ids, positions, blocks, slots) of a small prefix-sharing load."""
    block_size, num_blocks = 4, 20
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48)
    scheduler = Scheduler(config, manager, max_model_len=64)
    runner = StandInRunner(StepCost(), id_shift=id_shift)
    for index in range(12):
        request = Request(0.0, 9 + index % 5, 14, prefix_group=index // 4, prefix_len=8)
        prompt = token_ids(index, request, 0, request.prompt_len, id_shift=id_shift)
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        scheduler.add_request(
            EngineRequest(str(index), prompt, params, arrival_time=0.0, arrival_index=index)
        )
    trace = []
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        rows = [(s.seq_id, s.start_pos, s.block_table, s.slot_mapping) for s in step.rows()]
        trace.append((rows, step.preempted_request_ids, step.copies))
        scheduler.update(step, runner.execute(step))
    assert manager.stats()["prefix_cache_hits"] > 0  # the load does share prefixes
    assert scheduler.num_preemptions > 0  # and runs out of blocks
    return trace


def test_int32_ids_schedule_like_the_default() -> None:
    assert _trace(32) == _trace(7)  # positions stay below 2**7 = 128 > 64
