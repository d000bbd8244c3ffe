"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer over HTTP."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, model_validator

from pagedkv.server.protocol import ChatMessage, RequestModel, short
from pagedkv.server.responses import token_text
from pagedkv.server.serving import (
    APIError,
    ServerState,
    check_model,
    render_chat,
    require_tokenizer,
)


class TokenizeRequest(RequestModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = Field(None, description="Exactly one of prompt and messages.")
    messages: list[ChatMessage] | None = Field(
        None, description="Exactly one of prompt and messages."
    )
    add_special_tokens: bool | None = Field(
        None, description="Default: true for a prompt, false for messages (the template adds them)."
    )
    add_generation_prompt: bool = Field(True, description="Messages only.")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("expected exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenize_routes(app: FastAPI, responses: dict[int | str, Any]) -> None:
    """Register `POST /tokenize` and `POST /detokenize` (errors documented by `responses`)."""

    @app.post("/tokenize", response_model=TokenizeResponse, responses=responses)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state: ServerState = request.app.state.server
        check_model(state, body.model)
        if body.messages is not None:
            text = render_chat(state, body.messages, body.add_generation_prompt)["prompt"]
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        tokenizer = require_tokenizer(state, "prompt" if body.messages is None else "messages")
        ids = tokenizer.encode(text, add_special_tokens=add_special)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=state.max_model_len,
            tokens=ids,
            token_strs=[token_text(tokenizer, t) for t in ids] if body.return_token_strs else None,
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=responses)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state: ServerState = request.app.state.server
        check_model(state, body.model)
        tokenizer = require_tokenizer(state, "tokens")
        vocab = int(state.engine.engine.model_config.vocab_size)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                f"tokens: expected ids in [0, {vocab}), got {short(bad[0])}", param="tokens"
            )
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))
