"""`pagedkv plan` and `pagedkv simulate` through `pagedkv.cli.main`, and the torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.cli import main

PLAN_KEYS = {
    "weight_bytes",
    "kv_bytes_per_token",
    "kv_bytes_per_block",
    "kv_budget_bytes",
    "max_kv_tokens",
    "max_sequences_at_context",
    "weights_fit",
    "full_context_sequence_fits",
    "context_exceeds_model",
    "max_position_embeddings",
    "activation_margin",
    "activation_margin_bytes",
    "warnings",
}
RESULT_KEYS = {
    "policy",
    "admitted",
    "queued",
    "rejected",
    "peak_concurrency",
    "mean_concurrency",
    "mean_kv_utilization",
    "internal_fragmentation",
    "external_fragmentation",
    "fragmentation_stalls",
    "stall_examples",
}


def cli_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json(capsys):
    plan = cli_json(
        capsys,
        "plan",
        "--model",
        "llama-2-70b",
        "--memory",
        "80GiB",
        "--dtype",
        "fp16",
        "--context",
        "4k",
        "--json",
    )
    assert PLAN_KEYS <= set(plan)
    assert plan["kv_bytes_per_token"] == 327_680
    assert plan["weights_fit"] is False and plan["full_context_sequence_fits"] is False
    assert plan["context_exceeds_model"] is False and plan["warnings"] == []
    fp8 = cli_json(
        capsys,
        "plan",
        "--model",
        "llama-2-70b",
        "--memory",
        "80GiB",
        "--tp",
        "2",
        "--kv-dtype",
        "fp8",
        "--json",
    )
    assert fp8["kv_bytes_per_token"] == 327_680 // 2 // 2
    assert fp8["weights_fit"] is True and fp8["full_context_sequence_fits"] is True
    assert fp8["max_sequences_at_context"] > 0


def test_plan_counts_the_scales_of_an_int8_cache(capsys):
    """llama-3.1-8b: 32 layers x 8 KV heads x 2 (K, V) x (128 + a 2-byte scale)."""
    plans = {
        kv: cli_json(
            capsys,
            "plan",
            "--model",
            "llama-3.1-8b",
            "--memory",
            "80GiB",
            "--kv-cache-dtype",
            kv,
            "--json",
        )  # fmt: skip
        for kv in ("int8", "bf16", "float32")
    }
    assert plans["int8"]["kv_bytes_per_token"] == 2 * 32 * 8 * (128 + 2)
    tokens = {kv: p["max_kv_tokens"] for kv, p in plans.items()}
    assert tokens["int8"] >= 1.9 * tokens["bf16"] and tokens["int8"] >= 3.8 * tokens["float32"]


def test_plan_table_mentions_replicated_heads(capsys):
    assert main(["plan", "--model", "llama-3.1-405b", "--memory", "80GiB", "--tp", "16"]) == 0
    out = capsys.readouterr().out
    assert "KV per token" in out and "64,512 B" in out
    assert "replicated 2x" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "llama-9b", "--memory", "80GiB"], "unknown model 'llama-9b'"),
        (["plan", "--model", "qwen3-8b", "--memory", "80 parsecs"], "expected a size"),
        (["plan", "--model", "qwen3-8b", "--memory", "80GiB", "--context", "lots"], "token count"),
        (["plan", "--model", "llama-2-70b", "--memory", "80GiB", "--tp", "3"], "tp"),
        (
            ["simulate", "--model", "nope", "--kv-memory", "1GiB", "--workload", "chat"],
            "unknown model",
        ),
        (
            ["simulate", "--model", "qwen3-8b", "--kv-memory", "big", "--workload", "chat"],
            "expected a size",
        ),
        (
            [
                "simulate",
                "--model",
                "qwen3-8b",
                "--kv-memory",
                "1GiB",
                "--workload",
                "chat",
                "--policies",
                "paged,buddy",
            ],
            "policies",
        ),
    ],
)
def test_bad_input_is_one_line_and_nonzero(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_simulate_trace_json(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [{"arrival": i, "prompt_len": 100, "output_len": 20} for i in range(10)]
    lines.append({"arrival": 0, "prompt_len": 10**6, "output_len": 1})  # never fits
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    out = cli_json(
        capsys,
        "simulate",
        "--model",
        "llama-3.1-8b",
        "--kv-memory",
        "1GiB",
        "--trace",
        str(trace),
        "--json",
    )
    assert out["kv_bytes_per_token"] == 131_072 and out["requests"] == 11
    assert [p["policy"] for p in out["policies"]] == [
        "contiguous-max",
        "contiguous-first-fit",
        "paged",
        "paged-prefix",
    ]
    for policy in out["policies"]:
        assert RESULT_KEYS <= set(policy)
        assert (policy["admitted"], policy["rejected"]) == (10, 1)


def test_simulate_table_and_plots(tmp_path, capsys):
    argv = [
        "simulate",
        "--model",
        "qwen3-8b",
        "--kv-memory",
        "2GiB",
        "--workload",
        "chat",
        "--num-requests",
        "60",
        "--policies",
        "contiguous-first-fit,paged-prefix",
        "--plot",
        str(tmp_path / "plots"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "contiguous-first-fit" in out and "paged-prefix" in out
    for name in ("memory_use.png", "memory_map.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_sim_imports_without_torch_numpy_or_matplotlib():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pagedkv.sim import planner, simulator, policies, workload\n"
        "from pagedkv.cli import simulate\n"
        "from pagedkv.sim.workload import make_workload\n"
        "requests = make_workload('chat', 20)\n"
        "for name in policies.POLICIES:\n"
        "    policy = policies.create_policy(name, capacity_tokens=20000, num_blocks=1250,\n"
        "                                    block_size=16, max_len=6000)\n"
        "    assert simulator.simulate(requests, policy).admitted == 20\n"
        "assert not {'numpy', 'matplotlib'} & set(sys.modules), 'heavy import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plan_table_separates_weights_from_a_full_context_sequence(capsys):
    argv = ["plan", "--model", "llama-2-70b", "--memory", "80GiB", "--context", "128k"]
    assert main([*argv, "--tp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("warning: context 131,072 exceeds the model's")
    rows = {line[:29].strip(): line[30:] for line in lines[1:]}
    assert rows["weights fit"] == "yes"
    assert rows["a full-context sequence fits"].startswith("NO: one needs 20.00 GiB of KV")
    assert rows["sequences of 131,072"] == "0"
    assert rows["activation margin"].startswith("8.00 GiB (10% of memory")
    plan = cli_json(capsys, *argv, "--tp", "2", "--activation-margin", "0", "--json")
    assert plan["context_exceeds_model"] is True and plan["max_position_embeddings"] == 4096
    assert len(plan["warnings"]) == 1 and "4,096" in plan["warnings"][0]
    assert plan["activation_margin_bytes"] == 0
    assert plan["kv_budget_bytes"] == 80 * 2**30 - plan["weight_bytes"]


def test_simulate_help_lists_each_workload_mix(capsys):
    from pagedkv.sim.workload import WORKLOAD_MIXES, WORKLOADS

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo the wrapping
    assert set(WORKLOAD_MIXES) == set(WORKLOADS)
    for name in WORKLOADS:
        assert f"{name}: {WORKLOAD_MIXES[name]}" in out, name
    assert "long-context" in out and "seed:" not in out


def test_simulate_old_workload_name_still_runs(capsys):
    argv = ["simulate", "--model", "llama-3.1-8b", "--kv-memory", "40GiB", "--workload"]
    tail = ["--num-requests", "5", "--policies", "paged", "--json"]
    assert main([*argv, "seed", *tail]) == 0
    captured = capsys.readouterr()
    assert "--workload seed is now long-context" in captured.err
    old = json.loads(captured.out)
    new = cli_json(capsys, *argv, "long-context", *tail)
    assert old["workload"] == new["workload"] == "long-context"
    assert old["policies"][0]["admitted"] == new["policies"][0]["admitted"] == 5


def paged_figures(tmp_path, capsys, lines, *flags):
    """The paged policy's figures for a trace of `lines` under the given engine flags."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    argv = ["simulate", "--model", "llama-3.1-8b", "--kv-memory", "1GiB", "--trace", str(trace)]
    out = cli_json(capsys, *argv, "--policies", "paged", "--json", *flags)
    return out["policies"][0]


def test_simulate_max_num_seqs_caps_the_batch(tmp_path, capsys):
    # 40 requests of 100 + 20 tokens, all at step 0: the default budget of 2,048 tokens
    # takes 20 prompts and the first 48 tokens of a 21st in step 0, the other 19 wait a
    # step; the last ones admitted decode until step 20.
    lines = [{"arrival": 0, "prompt_len": 100, "output_len": 20}] * 40
    free = paged_figures(tmp_path, capsys, lines)
    assert (free["peak_concurrency"], free["steps"], free["queued"]) == (40, 21, 19)
    capped = paged_figures(tmp_path, capsys, lines, "--max-num-seqs", "4")
    # Ten waves of four requests, 20 steps each.
    assert (capped["peak_concurrency"], capped["steps"], capped["queued"]) == (4, 200, 36)
    assert capped["mean_wait_steps"] == 90.0 and capped["preemptions"] == 0


def test_simulate_max_num_batched_tokens_chunks_the_prefill(tmp_path, capsys):
    # A 1,000-token prompt and 10 outputs: one prefill step then 9 decode steps; with 256
    # tokens a step the prefill takes 4 chunks (the last one samples the first output).
    lines = [{"arrival": 0, "prompt_len": 1000, "output_len": 10}]
    whole = paged_figures(tmp_path, capsys, lines)
    assert (whole["engine_steps"], whole["steps"]) == (10, 10)
    chunked = paged_figures(tmp_path, capsys, lines, "--max-num-batched-tokens", "256")
    assert (chunked["engine_steps"], chunked["steps"]) == (13, 13)


def test_simulate_token_cost_stretches_the_clock_not_the_steps(tmp_path, capsys):
    # Each step takes 1 + 0.01 x its tokens: 1 + 10 for the prefill, 1.01 per decode;
    # 20.09 on the clock, rounded up.
    lines = [{"arrival": 0, "prompt_len": 1000, "output_len": 10}]
    result = paged_figures(tmp_path, capsys, lines, "--token-cost", "0.01")
    assert (result["engine_steps"], result["steps"]) == (10, 21)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs: expected > 0, got 0"),
        (["--max-num-batched-tokens", "-5"], "max_num_batched_tokens: expected > 0, got -5"),
        (["--token-cost", "-1"], "token-cost: expected a finite number >= 0, got -1.0"),
        (["--token-cost", "nan"], "token-cost: expected a finite number >= 0, got nan"),
        (["--token-cost", "inf"], "token-cost: expected a finite number >= 0, got inf"),
    ],
)
def test_simulate_bad_engine_flags_name_the_flag(capsys, flags, message):
    argv = ["simulate", "--model", "llama-3.1-8b", "--kv-memory", "1GiB", "--workload", "chat"]
    assert main([*argv, "--num-requests", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_simulate_keeps_only_the_window_of_sliding_layers(tmp_path, capsys):
    # Mistral-7B's layers all slide over 4,096 tokens: one sliding group. 64 requests of
    # 6,000 + 200 tokens in 8 GiB (4,096 blocks of 2 MiB): with every block kept (388 a
    # request) 10 fit at a time; with only the window's (257 between steps) 15 or more.
    trace = tmp_path / "t.jsonl"
    lines = [{"arrival": 0, "prompt_len": 6000, "output_len": 200}] * 64
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    argv = ["simulate", "--model", "mistral-7b", "--kv-memory", "8GiB", "--trace", str(trace)]
    out = cli_json(capsys, *argv, "--policies", "paged", "--json")
    assert out["num_blocks"] == 4096 and out["kv_group_windows"] == [4096]
    (paged,) = out["policies"]
    assert paged["admitted"] == 64 and paged["peak_concurrency"] >= 15
