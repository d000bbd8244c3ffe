"""SamplingParams validation and the sampler (no model)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.sampler import Sampler, create_generator
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n": 0}, "n: expected >= 1"),
        ({"n": 1.5}, "n: expected an integer"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.5}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature: expected a finite number"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 2**64}, "seed: expected <= 18446744073709551615"),
        ({"seed": -(2**63) - 1}, "seed: expected >= -9223372036854775808"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {5: 100.5}}, r"logit_bias\[5\]: expected in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalize() -> None:
    params = SamplingParams(stop="END", stop_token_ids=(5, 6), temperature=0)
    assert params.stop_strings == ("END",) and params.stop_token_ids == [5, 6]
    assert params.is_greedy and not SamplingParams().is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beam_width": 0, "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 0},
        {"beam_width": 2, "max_tokens": 4, "length_penalty": "x"},
    ],
)
def test_beam_search_params_reject_bad_values(kwargs) -> None:
    with pytest.raises(ValueError):
        BeamSearchParams(**kwargs)


def logits_batch(rows: int = 6, vocab: int = 40) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = logits_batch()
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler()
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
    ):
        gens = [None if params.is_greedy else create_generator(1, i) for i in range(6)]
        got = [r.token_id for r in sampler(logits, [params] * 6, gens)]
        assert got == argmax, params


def test_filters_keep_only_allowed_tokens() -> None:
    logits = logits_batch(rows=1)
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)
    sampler = Sampler()
    generator = create_generator(3, 0)
    seen_k, seen_p = set(), set()
    nucleus = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    for _ in range(300):
        seen_k.add(sampler(logits, [SamplingParams(top_k=3)], [generator])[0].token_id)
        seen_p.add(sampler(logits, [SamplingParams(top_p=0.5)], [generator])[0].token_id)
    assert seen_k == set(order[:3])
    assert seen_p == set(order[:nucleus])


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    generator = create_generator(0, 0)
    counts = torch.zeros(4)
    sampler = Sampler()
    for _ in range(4000):
        counts[sampler(logits, [SamplingParams(temperature=1.0)], [generator])[0].token_id] += 1
    expected = torch.softmax(logits[0], -1) * 4000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = logits_batch(rows=4)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    sampler = Sampler()
    alone = [sampler(logits[2:3], [params], [create_generator(9, 0)])[0].token_id for _ in range(1)]
    gens = [create_generator(s, 0) for s in (1, 2, 9, 4)]
    mixed = [SamplingParams(temperature=0), SamplingParams(top_k=5), params, params]
    batch = sampler(logits, mixed, [None, gens[1], gens[2], gens[3]])
    assert batch[2].token_id == alone[0]


def test_logprobs_are_raw_log_softmax_with_the_sampled_token() -> None:
    logits = logits_batch(rows=2)
    reference = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=2.0, logprobs=0),
    ]
    results = Sampler()(logits, params, [None, create_generator(0, 1)])
    top3 = reference[0].topk(3)
    assert results[0].top_logprobs == pytest.approx(
        dict(zip(top3.indices.tolist(), top3.values.tolist(), strict=True))
    )
    sampled = results[1].token_id
    assert results[1].top_logprobs == pytest.approx({sampled: reference[1, sampled].item()})
    assert results[1].logprob == pytest.approx(reference[1, sampled].item())


def test_logprobs_only_for_rows_that_ask() -> None:
    logits = logits_batch(rows=3)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    results = Sampler()(logits, params, [None, None, create_generator(0, 2)])
    assert [r.token_id for r in results[:2]] == logits[:2].argmax(-1).tolist()
    assert results[0].logprob is None and results[0].top_logprobs is None
    assert results[2].logprob is None and results[2].top_logprobs is None
    expected = torch.log_softmax(logits, -1)[1, results[1].token_id].item()
    assert results[1].top_logprobs == pytest.approx({results[1].token_id: expected})
    # No row asks: the same tokens, and no logprob at all.
    alone = Sampler()(
        logits, [params[0], params[0], params[2]], [None, None, create_generator(0, 2)]
    )
    assert [r.token_id for r in alone] == [r.token_id for r in results]
    assert all(r.logprob is None for r in alone)


def test_sampler_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="one per row"):
        Sampler()(logits_batch(rows=2), [SamplingParams()], [None])


def test_logit_bias_steers_sampling_but_not_logprobs() -> None:
    logits = logits_batch(rows=3)
    reference = torch.log_softmax(logits, -1)
    argmax = logits.argmax(-1).tolist()
    forced = (argmax[0] + 1) % logits.shape[1]
    params = [
        SamplingParams(temperature=0, logprobs=1, logit_bias={forced: 100}),
        SamplingParams(temperature=0, logit_bias={argmax[1]: -100}),
        SamplingParams(temperature=1.0, logit_bias={forced: 100.0}),
    ]
    results = Sampler()(logits, params, [None, None, create_generator(0, 0)])
    assert results[0].token_id == forced and results[2].token_id == forced
    assert results[0].logprob == pytest.approx(reference[0, forced].item())
    assert forced in results[0].top_logprobs  # the raw top-1 and the sampled token
    assert results[1].token_id == logits[1].topk(2).indices[1].item()
