"""`LLM`: offline batched generation, shaped like vLLM's."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.engine.args import EngineArgs, engine_args_help, engine_args_signature
from pagedkv.engine.engine import LLMEngine, PromptType
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.beam_search import BeamSearchOutput, EarlyStopping


class LLM:
    """Load a local Hugging Face model directory and generate for many prompts at once.

    Example::

        llm = LLM("path/to/model", num_blocks=512)
        outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
        print(outputs[0].outputs[0].text)

    The keyword arguments are the fields of `EngineArgs`; `LLM.__init__` lists them.
    """

    def __init__(self, model: str | Path, **kwargs: Any) -> None:
        """Load the model and size the KV cache.

        Args:
            model: a local model directory (config.json, *.safetensors, tokenizer.json).
            kwargs: the fields of `EngineArgs`:
                {options}

        Raises:
            TypeError: a keyword that is not a field of `EngineArgs`.
            ValueError: a bad option or a model directory that cannot be loaded.
        """
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, kwargs))
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        """The engine's counters (see `LLMEngine.stats`)."""
        return self.engine.stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; returns when all are done.

        Args:
            prompts: a string, a list of strings, a list of token ids, a list of token-id
                lists, or {"prompt_token_ids": [...]} dicts (or a list of them).
            sampling_params: one for all prompts, or one per prompt (default:
                `SamplingParams()`).
            use_tqdm: show a progress bar.

        Returns:
            One finished `RequestOutput` per prompt, in input order.

        Raises:
            ValueError: a bad prompt or params (nothing is left queued).
        """
        batch = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(
                    f"sampling_params: expected one per prompt ({len(batch)}), got {len(params)}"
                )
        self._compile_grammars(params)
        request_ids = []
        try:
            for prompt, param in zip(batch, params, strict=True):
                request_id = f"llm-{next(self._request_ids)}"
                self.engine.add_request(request_id, prompt, param)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def _compile_grammars(self, params: list[SamplingParams]) -> None:
        """Compile each distinct constraint before any request is queued, so a bad one is
        a ValueError here (each compiles once; the engine reuses the result)."""
        for constraint in {p.structured_outputs.key: p.structured_outputs for p in params
                           if p.structured_outputs is not None}.values():  # fmt: skip
            self.engine.structured_outputs.compiler.compile(constraint)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Reply to one conversation or a batch of them, as vLLM's `LLM.chat`.

        Each conversation ([{"role": ..., "content": ...}, ...]) is rendered with the chat
        template, encoded without adding special tokens (the template spells them out), and
        generated as `generate` would.

        Args:
            messages: one conversation, or a list of conversations.
            sampling_params: one for all conversations, or one per conversation.
            chat_template: a jinja2 template to use instead of the tokenizer's.
            add_generation_prompt: end the rendering with the assistant's turn opening.
            tools: OpenAI function tools ({"type": "function", "function": {...}}), passed
                to the template as `tools`.
            use_tqdm: show a progress bar.

        Returns:
            One finished `RequestOutput` per conversation, in input order.

        Raises:
            ValueError: no tokenizer or chat template, malformed messages, or bad params.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat: expected a model directory with a tokenizer, got none")
        if chat_template is not None:
            tokenizer = copy.copy(tokenizer)  # the engine's tokenizer keeps its own template
            tokenizer.chat_template = chat_template
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages: expected a non-empty list, got {messages!r:.60}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            tokenizer.chat_prompt(list(c), add_generation_prompt, tools) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        early_stopping: EarlyStopping = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over the paged cache: beams share blocks up to where they diverge.

        Returns:
            One `BeamSearchOutput` per prompt, its `sequences` best first.

        Raises:
            ValueError: a bad prompt or params, or unfinished requests in the engine.
        """
        from pagedkv.engine.beam_search import beam_search

        return beam_search(
            self.engine, _as_prompt_list(prompts), params, early_stopping=early_stopping
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm
        ) as progress:
            while len(finished) < len(wanted):
                if not self.engine.has_unfinished_requests():
                    missing = sorted(wanted - set(finished))
                    raise RuntimeError(f"requests {missing} left the engine unfinished")
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]


# What `help(LLM)` and `inspect.signature(LLM)` show comes from `EngineArgs`' fields.
LLM.__init__.__signature__ = engine_args_signature(method=True)  # type: ignore[attr-defined]
LLM.__init__.__doc__ = (LLM.__init__.__doc__ or "").replace(
    "{options}", engine_args_help(indent=" " * 16).lstrip()
)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    """Tell one prompt from a batch: a str, a dict or a flat list of ints is one prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts: expected at least one prompt, got an empty list")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise ValueError(f"prompts: expected str, list or dict, got {type(prompts).__name__}")
