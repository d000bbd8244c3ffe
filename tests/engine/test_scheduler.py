"""Scheduler tests against the real KVCacheManager and a model-free token source."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from engine_fakes import EOS, VOCAB, ChainRunner, reference_outputs, run_to_completion

from pagedkv.config import SchedulerConfig
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.memory import KVCacheManager


def make_scheduler(
    num_blocks: int,
    block_size: int,
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    mode: str = "recompute",
    num_host_blocks: int = 0,
    prefix: bool = True,
    max_model_len: int = 10_000,
    max_preemptions: int = 4,
) -> Scheduler:
    kv = KVCacheManager(
        num_blocks, block_size, enable_prefix_caching=prefix, num_host_blocks=num_host_blocks
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        max_preemptions=max_preemptions,
    )
    return Scheduler(config, kv, max_model_len=max_model_len, eos_token_ids=[EOS])


def make_requests(
    seed: int, count: int, *, max_prompt: int = 40, n_choices=(1,), shared_prefix: int = 0
) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    requests = []
    for i in range(count):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        params = SamplingParams(
            n=rng.choice(n_choices), max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5
        )
        requests.append(Request(f"r{i}", prompt, params, arrival_time=0.0, arrival_index=i))
    return requests


def check_outputs(requests: list[Request], outputs: dict[str, list[list[int]]]) -> None:
    for request in requests:
        expected = reference_outputs(request.prompt_token_ids, request.params)
        assert outputs[request.request_id] == expected, request.request_id


def test_scheduler_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pagedkv.engine.scheduler, pagedkv.engine.request, pagedkv.engine.planning\n"
        "import pagedkv.engine.stop, pagedkv.engine.scheduler_output\n"
        "import pagedkv.engine.sampling_params, pagedkv.engine.outputs\n"
        "import pagedkv.memory\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("prefix", [True, False])
def test_roomy_pool_matches_reference(block_size: int, prefix: bool) -> None:
    scheduler = make_scheduler(2000, block_size, budget=24, prefix=prefix)
    requests = make_requests(block_size, 12, n_choices=(1, 2, 3), shared_prefix=9)
    outputs = run_to_completion(scheduler, ChainRunner(block_size), requests)
    check_outputs(requests, outputs)
    assert scheduler.num_preemptions == 0
    assert scheduler.kv.num_free_blocks == 2000 and len(scheduler.kv) == 0


@pytest.mark.parametrize("mode,host", [("recompute", 0), ("swap", 64), ("swap", 6)])
@pytest.mark.parametrize("block_size", [2, 5])
@pytest.mark.parametrize("prefix", [True, False])
def test_tiny_pool_preempts_and_matches_reference(
    mode: str, host: int, block_size: int, prefix: bool
) -> None:
    num_blocks = 60 // block_size + 2  # room for one longest request and a little more
    scheduler = make_scheduler(
        num_blocks,
        block_size,
        budget=16,
        mode=mode,
        num_host_blocks=host,
        prefix=prefix,
        max_model_len=60,
    )
    requests = make_requests(100 + block_size, 10, max_prompt=28, n_choices=(1, 2), shared_prefix=3)
    outputs = run_to_completion(scheduler, ChainRunner(block_size), requests)
    for request in requests:
        expected = reference_outputs(request.prompt_token_ids, request.params, max_model_len=60)
        got = outputs[request.request_id]
        # A sample that could not grow alone in the pool ends early with "length".
        for seq, exp, out in zip(request.seqs, expected, got, strict=True):
            if seq.finish_reason == "length" and len(out) < len(exp):
                assert out == exp[: len(out)]
            else:
                assert out == exp, request.request_id
    assert scheduler.num_preemptions > 0
    if mode == "swap" and host >= 64:
        assert scheduler.num_swapped_out > 0
    assert scheduler.kv.num_free_blocks == num_blocks and len(scheduler.kv) == 0
    assert scheduler.kv.num_free_host_blocks == host


def test_admission_takes_only_the_first_chunk() -> None:
    scheduler = make_scheduler(100, 4, budget=16)
    request = Request(
        "a", list(range(40)), SamplingParams(max_tokens=500), arrival_time=0, arrival_index=0
    )
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert [len(s.token_ids) for s in step.rows()] == [16]
    assert len(scheduler.kv.block_table(("a", 0))) == 4  # not 40 + 500 tokens' worth
    assert step.rows()[0].sample_seq_ids == []


def test_decodes_go_before_prefill_chunks() -> None:
    scheduler = make_scheduler(100, 4, budget=8)
    runner = ChainRunner(4)
    first = Request(
        "a",
        [1, 2, 3],
        SamplingParams(max_tokens=50, ignore_eos=True),
        arrival_time=0,
        arrival_index=0,
    )
    scheduler.add_request(first)
    step = scheduler.schedule()
    scheduler.update(step, runner.execute(step))
    scheduler.add_request(
        Request("b", list(range(30)), SamplingParams(), arrival_time=0, arrival_index=1)
    )
    step = scheduler.schedule()
    assert [(s.seq_id, len(s.token_ids)) for s in step.rows()] == [(("a", 0), 1), (("b", 0), 7)]
    # A prefill chunk already running yields to newer decodes too: the budget reserves them.
    scheduler.update(step, runner.execute(step))
    step = scheduler.schedule()
    assert [(s.seq_id, len(s.token_ids)) for s in step.rows()] == [(("a", 0), 1), (("b", 0), 7)]


def test_prefix_cache_skips_cached_blocks() -> None:
    scheduler = make_scheduler(100, 4, budget=64)
    runner = ChainRunner(4)
    shared = list(range(1, 13))
    first = Request(
        "a", shared + [20], SamplingParams(max_tokens=1), arrival_time=0, arrival_index=0
    )
    run_to_completion(scheduler, runner, [first])
    second = Request(
        "b", shared + [21, 22], SamplingParams(max_tokens=1), arrival_time=0, arrival_index=1
    )
    scheduler.add_request(second)
    step = scheduler.schedule()
    assert step.rows()[0].start_pos == 12 and step.rows()[0].token_ids == [21, 22]
    assert second.metrics.num_cached_tokens == 12


def test_finished_request_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(50, 4)
    runner = ChainRunner(4)
    request = Request(
        "a", list(range(10)), SamplingParams(max_tokens=1), arrival_time=0, arrival_index=0
    )
    scheduler.add_request(request)
    step = scheduler.schedule()
    scheduler.update(step, runner.execute(step))
    assert request.status is RequestStatus.FINISHED and request.seqs[0].finish_reason == "length"
    assert len(scheduler.kv) == 0 and scheduler.num_running == 0


def test_impossible_request_is_rejected_and_the_next_runs() -> None:
    scheduler = make_scheduler(4, 4, max_model_len=100)
    with pytest.raises(ValueError, match="fits the pool"):
        scheduler.add_request(
            Request("big", list(range(16)), SamplingParams(), arrival_time=0, arrival_index=0)
        )
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(100, 4, max_model_len=10).add_request(
            Request("long", list(range(10)), SamplingParams(), arrival_time=0, arrival_index=0)
        )
    ok = Request(
        "ok", list(range(15)), SamplingParams(max_tokens=1), arrival_time=0, arrival_index=1
    )
    outputs = run_to_completion(scheduler, ChainRunner(4), [ok])
    assert outputs["ok"] == reference_outputs(ok.prompt_token_ids, ok.params)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(ok)
        scheduler.add_request(ok)


def test_abort_returns_blocks() -> None:
    scheduler = make_scheduler(50, 4, mode="swap", num_host_blocks=20)
    runner = ChainRunner(4)
    for i in range(3):
        scheduler.add_request(
            Request(
                f"r{i}",
                list(range(9)),
                SamplingParams(n=2, max_tokens=9),
                arrival_time=0,
                arrival_index=i,
            )
        )
    for _ in range(3):
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step))
    for i in range(3):
        scheduler.abort_request(f"r{i}")
    scheduler.abort_request("unknown")
    scheduler.kv.check()
    assert len(scheduler.kv) == 0 and scheduler.kv.num_free_blocks == 50
    assert not scheduler.has_unfinished_requests()


def test_n_samples_share_prompt_blocks() -> None:
    scheduler = make_scheduler(100, 4, budget=64)
    runner = ChainRunner(4)
    request = Request(
        "a",
        list(range(10)),
        SamplingParams(n=4, max_tokens=3, ignore_eos=True),
        arrival_time=0,
        arrival_index=0,
    )
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert step.rows()[0].sample_seq_ids == [("a", i) for i in range(4)]
    scheduler.update(step, runner.execute(step))
    # After the fork: 3 prompt blocks held by all four samples, nothing copied yet.
    assert scheduler.kv.stats()["num_used_blocks"] == 3
    step = scheduler.schedule()
    # The shared partial last block is copied on write for 3 of the 4 samples.
    assert len(step.copies) == 3
    scheduler.update(step, runner.execute(step))
    assert scheduler.kv.stats()["num_used_blocks"] == 2 + 4


def test_thrash_bound_protects_an_often_preempted_request() -> None:
    counts = {}
    for bound in (1, 4):
        scheduler = make_scheduler(12, 2, budget=64, max_preemptions=bound)
        requests = [
            Request(
                f"r{i}",
                list(range(4)),
                SamplingParams(max_tokens=14, ignore_eos=True),
                arrival_time=0,
                arrival_index=i,
            )
            for i in range(3)
        ]
        outputs = run_to_completion(scheduler, ChainRunner(2), requests)
        check_outputs(requests, outputs)
        counts[bound] = [r.metrics.num_preemptions for r in requests]
    # Unbounded, the newest request is the victim again and again; with a bound of 1 a
    # request preempted twice runs ahead of the others, which become the victims.
    assert counts[4] == [0, 1, 3]
    assert max(counts[1]) <= 2 and sum(counts[1]) >= 3


def test_swapped_request_resumes_before_newer_admissions() -> None:
    scheduler = make_scheduler(10, 2, budget=64, mode="swap", num_host_blocks=10)
    runner = ChainRunner(2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(2):
        scheduler.add_request(Request(f"r{i}", [1, 2], params, arrival_time=0, arrival_index=i))
    first_step: dict[str, int] = {}
    swapped_in_at = None
    for t in range(200):
        if t == 8:
            late = Request("late", [3, 4], params, arrival_time=0, arrival_index=2)
            scheduler.add_request(late)
        step = scheduler.schedule()
        if step.swap_in and swapped_in_at is None:
            swapped_in_at = t
        for seq in step.rows():
            first_step.setdefault(seq.seq_id[0], t)
        scheduler.update(step, runner.execute(step))
        scheduler.kv.check()
        if not scheduler.has_unfinished_requests():
            break
    assert scheduler.num_swapped_out == 1 and swapped_in_at is not None
    assert swapped_in_at <= first_step["late"]
    assert late.seqs[0].output_token_ids == reference_outputs([3, 4], params)[0]


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_and_aborts(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 8])
    num_blocks = 80 // block_size + 4
    mode = rng.choice(["recompute", "swap"])
    scheduler = make_scheduler(
        num_blocks,
        block_size,
        budget=rng.choice([4, 16, 64]),
        mode=mode,
        num_host_blocks=rng.choice([0, 8, 100]),
        prefix=rng.random() < 0.7,
        max_num_seqs=rng.choice([3, 5, 16]),
        max_preemptions=rng.choice([0, 2, 4]),
        max_model_len=80,
    )
    runner = ChainRunner(block_size)
    pending = make_requests(
        1000 + seed, 14, max_prompt=30, n_choices=(1, 2, 3), shared_prefix=rng.choice([0, 5])
    )
    requests, aborted = [], set()
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            requests.append(pending.pop())
            scheduler.add_request(requests[-1])
        if requests and rng.random() < 0.03:
            victim = rng.choice(requests).request_id
            if scheduler.abort_request(victim) is not None:
                aborted.add(victim)
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step))
        scheduler.kv.check()
        if not pending and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == num_blocks and len(scheduler.kv) == 0
    for request in requests:
        expected = reference_outputs(request.prompt_token_ids, request.params, max_model_len=80)
        for seq, exp in zip(request.seqs, expected, strict=False):
            out = seq.output_token_ids
            # Aborted or cut by the pool: a prefix of the reference; otherwise all of it.
            if request.request_id in aborted or seq.finish_reason == "length":
                assert out == exp[: len(out)]
            else:
                assert out == exp


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [2, 4])
def test_recomputed_n_sample_request_is_readmitted(seed: int, block_size: int) -> None:
    """A preempted n = 4 request is recomputed sample by sample when it is alone: counted
    as four separate prompts it would never fit the pool, and the engine would wait for
    blocks nobody frees."""
    num_blocks = 60 // block_size + 4
    scheduler = make_scheduler(num_blocks, block_size, budget=16, max_model_len=60)
    requests = make_requests(seed, 8, max_prompt=28, n_choices=(1, 4), shared_prefix=3)
    outputs = run_to_completion(scheduler, ChainRunner(block_size), requests, max_steps=5000)
    for request in requests:
        expected = reference_outputs(request.prompt_token_ids, request.params, max_model_len=60)
        for seq, exp, out in zip(request.seqs, expected, outputs[request.request_id], strict=True):
            assert out == (exp[: len(out)] if seq.finish_reason == "length" else exp)
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.num_free_blocks == num_blocks and len(scheduler.kv) == 0
