"""The scheduler's one step path on a mixed load: every request generates what a
cache-free reference generates, through admissions, chunked prefill, preemption
(recompute and swap), n > 1 forks, prompt logprobs, EOS, aborts and late arrivals, and
the manager's state stays consistent after every step.
"""

from __future__ import annotations

import random

import pytest
from engine_fakes import EOS, VOCAB, ChainRunner, reference_outputs

from pagedkv.config import SchedulerConfig
from pagedkv.engine.request import Request
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.memory import KVCacheManager


def _scheduler(num_blocks: int, block_size: int, mode: str) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks=4 * num_blocks)
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=48, preemption_mode=mode)
    return Scheduler(config, kv, max_model_len=200, eos_token_ids=[EOS])


def _requests(seed: int, count: int) -> list[Request]:
    """The same requests on every call with the same seed (fresh objects)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    requests = []
    for i in range(count):
        own = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        prompt = shared[: rng.randint(0, 20)] + own
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]),
            max_tokens=rng.randint(1, 40),
            ignore_eos=rng.random() < 0.7,
            prompt_logprobs=1 if rng.random() < 0.15 else None,
        )
        requests.append(Request(f"r{i}", prompt, params, arrival_time=0.0, arrival_index=i))
    return requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_mixed_load_matches_the_reference(seed: int, mode: str) -> None:
    block_size = (2, 4, 16)[seed % 3]
    num_blocks = 600 // block_size if seed % 2 else 140 // block_size  # roomy or preempting
    scheduler, runner = _scheduler(num_blocks, block_size, mode), ChainRunner(block_size)
    pending, aborted = _requests(seed, 30), set()
    requests = list(pending)
    rng = random.Random(seed)
    steps = num_decode_rows = 0
    while scheduler.has_unfinished_requests() or pending:
        for _ in range(min(len(pending), rng.randint(0, 3))):
            scheduler.add_request(pending.pop(0))
        if steps % 17 == 5 and scheduler.running:
            aborted.add(scheduler.running[-1].request_id)
            scheduler.abort_request(scheduler.running[-1].request_id)
        step = scheduler.schedule()
        num_decode_rows += step.query_lens.count(1)
        scheduler.update(step, runner.execute(step))
        scheduler.kv.check()
        steps += 1
        assert steps < 5000, "no progress"
    assert num_decode_rows > 100
    assert seed % 2 or scheduler.num_preemptions > 0, "the small pool never preempted"
    for request in requests:
        if request.request_id not in aborted:
            expected = reference_outputs(request.prompt_token_ids, request.params, 200)
            assert [s.output_token_ids for s in request.seqs] == expected, request.request_id
