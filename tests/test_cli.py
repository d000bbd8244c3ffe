"""The `pagedkv` command line: every command's --help, `generate` and a quick `demo`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_hf_model, make_tokenizer

from pagedkv.cli import main

COMMANDS = ["serve", "generate", "demo", "plan", "simulate"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_hf_model(tmp_path_factory.mktemp("cli-model"), "llama")
    make_tokenizer(path)
    return path


@pytest.mark.parametrize("argv", [[]] + [[c] for c in COMMANDS], ids=["pagedkv", *COMMANDS])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pagedkv")
    if not argv:
        assert all(command in out for command in COMMANDS)


def test_help_does_not_import_torch():
    code = (
        "import sys; from pagedkv.cli import build_parser; build_parser(); "
        "sys.exit(1 if 'torch' in sys.modules or 'fastapi' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_serve_flags_named_after_llm_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--block-size",
        "--num-blocks",
        "--kv-cache-memory",
        "--swap-space",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--no-prefix-caching",
        "--preemption-mode",
        "--dtype",
        "--device",
        "--host",
        "--port",
        "--max-waiting-requests",
        "--tool-call-parser",
    ):
        assert flag in out, flag


ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-blocks", "64"]


def test_generate_streams_what_llm_returns(model_dir, capsys):
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    rc = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "The quick brown fox",
            "--max-tokens",
            "10",
            "--temperature",
            "0",
            "--ignore-eos",
            *ENGINE_FLAGS,
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert "10 tokens" in captured.err and "finish_reason=length" in captured.err
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=4, num_blocks=64)
    expected = (
        llm.generate(
            "The quick brown fox",
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert captured.out == expected + "\n"


def test_generate_bad_model_dir_is_one_line_error(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "config.json" in err and "Traceback" not in err


def test_demo_quick():
    from pagedkv.cli.demo import DEMO_MODEL_CONFIG
    from pagedkv.cli.demo_workload import make_workload

    # A subprocess: the demo sets its OpenMP policy before torch loads (see the command).
    argv = [
        "demo",
        "--random",
        "--num-requests",
        "6",
        "--max-model-len",
        "128",
        "--block-size",
        "8",
        "--no-progress",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    requests = make_workload(6, DEMO_MODEL_CONFIG["vocab_size"], 0, 128)
    expected_generated = sum(r.n * r.max_tokens for r in requests)  # EOS is ignored
    assert f"{expected_generated} generated" in out, out
    for row in ("throughput", "peak KV use", "prefix cache", "preemptions", "admitted at once"):
        assert row in out, row
    peak = re.search(r"peak KV use\s+(\d+) blocks \((\d+)%\)", out)
    assert peak is not None and 0 < int(peak.group(2)) <= 100
