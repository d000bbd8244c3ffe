"""The scheduler's decode fast path decides exactly what the general path decides.

Two schedulers run the same requests in lockstep, one with the fast path and one without;
every `SchedulerOutput` (the fast path's plain decodes as compact rows, the general path's
as objects), every sampled token and the managers' state must agree at every step, through
admissions, chunked prefill, preemption (recompute and swap), n > 1 forks, prompt
logprobs, EOS, aborts and late arrivals.
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


def _scheduler(num_blocks: int, block_size: int, mode: str, *, fast: bool) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks=4 * num_blocks)
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=48, preemption_mode=mode)
    scheduler = Scheduler(config, kv, max_model_len=200, eos_token_ids=[EOS])
    scheduler.decode_fast_path = fast
    return scheduler


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
def test_fast_path_outputs_match_the_general_path(seed: int, mode: str) -> None:
    block_size = (2, 4, 16)[seed % 3]
    num_blocks = 600 // block_size if seed % 2 else 140 // block_size  # roomy or preempting
    pair = [_scheduler(num_blocks, block_size, mode, fast=f) for f in (True, False)]
    runners = [ChainRunner(block_size) for _ in pair]
    appended = []  # count the fast path's appends: it must have run
    fast_kv = pair[0].kv
    real_append_token = fast_kv.append_token

    def counting_append_token(*args: object) -> list[int] | None:
        table = real_append_token(*args)
        appended.append(table is not None)
        return table

    fast_kv.append_token = counting_append_token
    arrivals = [_requests(seed, 30) for _ in pair]
    rng = random.Random(seed)
    steps = num_decode_rows = 0
    while any(s.has_unfinished_requests() for s in pair) or arrivals[0]:
        num_new = rng.randint(0, 3)
        for scheduler, pending in zip(pair, arrivals, strict=True):
            for _ in range(min(len(pending), num_new)):
                scheduler.add_request(pending.pop(0))
        if steps % 17 == 5 and pair[0].running:
            victim = pair[0].running[-1].request_id
            for scheduler in pair:
                scheduler.abort_request(victim)
        outputs = [s.schedule() for s in pair]
        assert outputs[0] == outputs[1], f"step {steps}: the fast path decided otherwise"
        # The fast path's rows stay compact `DecodeRow`s (the runner and `update` take
        # them so), and every view of them matches the general path's objects.
        fast, general = outputs
        assert not general.decode_rows
        num_decode_rows += len(fast.decode_rows)
        assert fast.model_inputs() == general.model_inputs()
        assert fast.sample_rows() == general.sample_rows()
        assert fast.seq_ids() == general.seq_ids()
        assert fast.num_batched_tokens == general.num_batched_tokens
        sampled = [r.execute(o) for r, o in zip(runners, outputs, strict=True)]
        assert sampled[0] == sampled[1]
        for scheduler, out, tokens in zip(pair, outputs, sampled, strict=True):
            scheduler.update(out, tokens)
            scheduler.kv.check()
        assert pair[0].kv.stats() == pair[1].kv.stats()
        assert pair[0].num_preemptions == pair[1].num_preemptions
        steps += 1
        assert steps < 5000, "no progress"
    assert sum(appended) > 100, "the fast path never ran"
    assert num_decode_rows == sum(appended), "a fast-path row left the compact form"
    assert seed % 2 or pair[0].num_preemptions > 0, "the small pool never preempted"


def test_fast_path_requests_match_the_reference() -> None:
    scheduler = _scheduler(64, 4, "recompute", fast=True)
    runner = ChainRunner(4)
    requests = _requests(7, 20)
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step))
        scheduler.kv.check()
    for request in requests:
        expected = reference_outputs(request.prompt_token_ids, request.params, 200)
        assert [s.output_token_ids for s in request.seqs] == expected, request.request_id
