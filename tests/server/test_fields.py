"""Every request field honoured or refused, through the official `openai` client; the model
routes, the tokenizer routes and the OpenAPI document."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


REFUSED_COMPLETION = [
    ("suffix", {"suffix": "tail"}),
    ("best_of", {"best_of": 4}),
    ("logit_bias", {"logit_bias": {"5": 250}}),
    ("frobnicate", {"extra_body": {"frobnicate": True}}),
]
REFUSED_CHAT = [
    ("response_format", {"response_format": {"type": "json_schema"}}),
    # No --tool-call-parser and a chat template without a tool-call format.
    ("tool-call-parser", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("top_logprobs", {"top_logprobs": 2}),
]


@pytest.mark.parametrize(
    ("field", "kwargs"), REFUSED_COMPLETION, ids=[f for f, _ in REFUSED_COMPLETION]
)
def test_refused_completion_field(client, field, kwargs):
    # Non-finite values are refused too; tests/server/test_errors.py sends them raw.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, **kwargs)
    assert field in info.value.message


@pytest.mark.parametrize(("field", "kwargs"), REFUSED_CHAT, ids=[f for f, _ in REFUSED_CHAT])
def test_refused_chat_field(client, field, kwargs):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, **kwargs)
    assert field in info.value.message


def test_best_of_equal_to_n_and_text_format_are_accepted(client):
    result = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2, n=2, best_of=2, seed=1
    )
    assert len(result.choices) == 2
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, response_format={"type": "text"}
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_steers_both_endpoints(client):
    forced = 77
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=[1, 40, 41],
        max_tokens=5,
        temperature=0.0,
        logit_bias={str(forced): 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    unbiased = client.completions.create(
        model=MODEL_NAME, prompt=[1, 40, 41], max_tokens=5, temperature=0.0, logprobs=0
    )
    tokens = result.choices[0].logprobs.tokens
    assert len(tokens) == 5 and len(set(tokens)) == 1
    assert unbiased.choices[0].logprobs.tokens != tokens
    # Logprobs stay those of the unbiased logits: a forced token is not certain.
    assert all(lp < -0.01 for lp in result.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0.7,
        seed=3,
        logit_bias={str(forced): 100},
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert len({t.token for t in chat.choices[0].logprobs.content}) == 1


def test_tokenize_and_detokenize(server):
    url = server.url
    text = "The quick brown fox"
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["tokens"][0] == 1 and tokens["max_model_len"] == 1024  # BOS added
    plain = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert plain.json()["tokens"] == tokens["tokens"][1:]
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"][0] == 1 and chat["count"] > tokens["count"]
    both = httpx.post(f"{url}/tokenize", json={"prompt": text, "messages": MESSAGES})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/tokenize", json={"model": "x", "prompt": "a"}).status_code == 404


def test_openapi_states_what_the_server_does(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    text = str(schema)
    assert "'422'" not in text and "HTTPValidationError" not in text
    completions = schema["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "404", "503"} <= set(completions["responses"])
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "echo" in fields["max_tokens"]["description"]
    assert {"/v1/models/{model_id}", "/tokenize", "/detokenize"} <= set(schema["paths"])
