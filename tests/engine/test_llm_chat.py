"""`LLM.chat`: one conversation or a batch, equal to `generate` on the rendered template."""

from __future__ import annotations

import pytest
from helpers import make_hf_model, make_tokenizer

from pagedkv import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "Say hello."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The quick brown fox?"},
        {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": "over what?"},
    ],
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = make_hf_model(tmp_path_factory.mktemp("chat"), "llama", seed=4)
    make_tokenizer(model_dir, vocab_size=400)
    return LLM(model_dir, device="cpu", dtype="float32", num_blocks=128, block_size=8)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_chat_equals_generate_on_the_template(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    by_hand = [
        tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False)
        for c in CONVERSATIONS
    ]
    expected = llm.generate(by_hand, params, use_tqdm=False)
    batch = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in batch] == by_hand
    assert _tokens(batch) == _tokens(expected)
    assert [o.outputs[0].text for o in batch] == [o.outputs[0].text for o in expected]
    one = llm.chat(CONVERSATIONS[1], params, use_tqdm=False)
    assert len(one) == 1 and _tokens(one) == _tokens(expected)[1:]
    assert one[0].prompt == tokenizer.apply_chat_template(CONVERSATIONS[1])


def test_chat_template_override_and_no_generation_prompt(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = llm.chat(
        CONVERSATIONS[0],
        params,
        chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
        use_tqdm=False,
    )
    assert plain[0].prompt == "Say hello.\n"
    assert tokenizer.chat_template is not None and "im_start" in tokenizer.chat_template
    bare = llm.chat(CONVERSATIONS[0], params, add_generation_prompt=False, use_tqdm=False)
    assert not bare[0].prompt.endswith("assistant\n")


def test_chat_rejects_bad_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)
