"""Workloads: JSONL traces (good and bad lines) and the seeded synthetic loads."""

from __future__ import annotations

import json
from statistics import mean

import pytest

from pagedkv.sim.workload import Request, load_trace, make_workload


def write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_round_trip_sorted_by_arrival(tmp_path):
    path = write(
        tmp_path,
        [
            json.dumps({"arrival": 5, "prompt_len": 10, "output_len": 2}),
            "",
            json.dumps(
                {
                    "arrival": 1.5,
                    "prompt_len": 40,
                    "output_len": 8,
                    "prefix_group": 3,
                    "prefix_len": 32,
                }
            ),
        ],
    )
    assert load_trace(path) == [
        Request(1.5, 40, 8, prefix_group=3, prefix_len=32),
        Request(5.0, 10, 2),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "Expecting value"),
        ("[1, 2]", "expected a JSON object"),
        ('{"arrival": 0, "output_len": 3}', "missing prompt_len"),
        ('{"arrival": 0, "prompt_len": 0, "output_len": 3}', "expected >= 1"),
        ('{"arrival": -1, "prompt_len": 2, "output_len": 3}', "arrival"),
        ('{"prompt_len": 2.5, "output_len": 3}', "expected an integer"),
        ('{"prompt_len": 4, "output_len": 3, "prefix_group": 0, "prefix_len": 5}', "prefix_len"),
        ('{"prompt_len": 4, "output_len": 3, "prefix_len": 2}', "needs a prefix_group"),
        ('{"prompt_len": 4, "output_len": 3, "tokens": 2}', "unknown field"),
    ],
)
def test_bad_trace_line_names_the_line(tmp_path, line, message):
    good = json.dumps({"arrival": 0, "prompt_len": 1, "output_len": 1})
    path = write(tmp_path, [good, line])
    with pytest.raises(ValueError, match=message) as info:
        load_trace(path)
    assert f"{path}:2:" in str(info.value)


def test_missing_or_empty_trace(tmp_path):
    with pytest.raises(ValueError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="at least one request"):
        load_trace(write(tmp_path, [""]))


def test_sharegpt_lengths_are_long_tailed_with_sharegpt_means():
    requests = make_workload("sharegpt", 20_000, seed=1)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert 145 < mean(prompts) < 175 and 310 < mean(outputs) < 370
    assert sorted(prompts)[len(prompts) // 2] < mean(prompts)  # median below mean: long tail
    assert max(prompts) <= 4096 and max(outputs) <= 4096
    assert all(r.arrival == 0 for r in requests)


def test_workloads_are_deterministic_per_seed():
    for name in ("sharegpt", "seed", "chat"):
        assert make_workload(name, 50, seed=7) == make_workload(name, 50, seed=7)
        assert make_workload(name, 50, seed=7) != make_workload(name, 50, seed=8)


def test_seed_mix_and_poisson_arrivals():
    requests = make_workload("seed", 2000, seed=0, rate=0.5)
    totals = {r.total_len for r in requests}
    assert totals == {131_072, 65_536, 512}
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals)
    assert 0.4 < len(requests) / arrivals[-1] < 0.6  # mean rate per step


def test_chat_requests_share_system_prompts():
    requests = make_workload("chat", 400, seed=0)
    groups = {}
    for r in requests:
        assert 500 <= r.prefix_len < r.prompt_len
        groups.setdefault(r.prefix_group, set()).add(r.prefix_len)
    assert len(groups) == 4 and all(len(lengths) == 1 for lengths in groups.values())


def test_bad_workload_arguments():
    with pytest.raises(ValueError, match="workload: expected one of"):
        make_workload("alpaca", 10)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("chat", 0)
    with pytest.raises(ValueError, match="rate"):
        make_workload("sharegpt", 10, rate=-1.0)
