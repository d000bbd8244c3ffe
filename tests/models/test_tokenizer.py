"""Tokenizer loading, chat template and incremental detokenization on a trained tiny BPE."""

from __future__ import annotations

import json

import pytest
from helpers import make_tokenizer

from pagedkv.models.loader import load_tokenizer
from pagedkv.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The quick brown fox.",
    "héllo wörld, ça va?",
    "你好，世界。",
    "emoji 🙂🚀 done",
    "unseen: Ωμέγα ∑ 🤖",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    loaded = load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))
    assert loaded is not None
    return loaded


def test_special_tokens_and_vocab(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.vocab_size == 400
    assert tokenizer.encode("fox")[0] == 1
    assert 1 not in tokenizer.encode("fox", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:2] == [1, 3]  # <s> <|im_start|> stay single special tokens


def test_chat_template_jinja_file_and_missing_template(tmp_path):
    model_dir = make_tokenizer(tmp_path)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "x"}])
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    )
    rendered = Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered == "[user] x"


def test_no_tokenizer_and_broken_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_deltas_concatenate_to_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    generated = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(token_id) for token_id in generated]
    assert "".join(deltas) == tokenizer.decode(generated) == text
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_waits_for_multibyte_characters(tokenizer):
    # Byte-level tokens of one 4-byte emoji: the first three complete nothing.
    byte_ids = [tokenizer._tokenizer.token_to_id(c) for c in "ðŁ¤ĸ"]  # bytes of 🤖
    assert None not in byte_ids
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert [detok.add(i) for i in byte_ids] == ["", "", "", "🤖"]
