"""`pagedkv chat [--model DIR|FILE.gguf]`: a multi-turn chat in the terminal (without
--model, the demo's SmolLM2 when installed, see `pagedkv.cli.demo.DEMO_EXTRA_HINT`).

Each turn renders the whole history through the model's chat template and submits it as a
new request; the earlier turns' KV blocks are still in the prefix cache, so only the new
tokens are computed (`/stats` shows how much was reused). Replies stream as they are
sampled; Ctrl-C stops a reply (the request is aborted, its blocks go back to the pool) and
the chat goes on. Commands: /reset, /stats, /help, /exit.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.runtime import kernel_cache

_HELP = "/reset forgets the conversation, /stats shows the KV cache, /exit leaves (or Ctrl-D)"


@dataclass
class Turn:
    """One reply: its prompt, how much of it the prefix cache served, what was generated."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    finish_reason: str | None


@dataclass
class ChatSession:
    """A conversation with one model: history, sampling settings and per-turn counts.

    Attributes:
        engine: an `LLMEngine` whose tokenizer has a chat template.
        params: how each reply is sampled (`max_tokens` is cut to what the context leaves).
        system: an optional system message heading the history.
    """

    engine: Any
    params: Any
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError("chat: expected a model with a tokenizer and a chat template")
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the prefix cache keeps its blocks until evicted)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = []

    def prompt_token_ids(self) -> list[int]:
        """The history rendered by the chat template, ready for the assistant's reply."""
        return self.engine.tokenizer.chat_prompt(self.messages)["prompt_token_ids"]

    def reply(
        self,
        user_text: str,
        write: Callable[[str], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> str:
        """Add a user message, stream the reply through `write`, add it to the history.

        Args:
            write: called with each new piece of the reply's text.
            should_stop: polled between engine steps; True aborts the reply, and what was
                written so far stays in the history.

        Returns:
            The reply's text.

        Raises:
            ValueError: the conversation no longer fits the model's context (the message
                is not kept).
        """
        self.messages.append({"role": "user", "content": user_text})
        ids = self.prompt_token_ids()
        room = self.engine.max_model_len - len(ids)
        if room < 1:
            self.messages.pop()
            raise ValueError(
                f"the conversation ({len(ids)} tokens) fills the model's context "
                f"({self.engine.max_model_len}): /reset to start again"
            )
        params = replace(self.params, max_tokens=min(self.params.max_tokens, room))
        request_id = f"chat-{len(self.turns)}-{id(self.messages)}"
        self.engine.add_request(request_id, ids, params)
        text, output, stopped = "", None, False
        while self.engine.has_unfinished_requests():
            if should_stop():
                self.engine.abort_request(request_id)
                stopped = True
                break
            for output in self.engine.step():
                new_text = output.outputs[0].text
                if len(new_text) > len(text):
                    write(new_text[len(text) :])
                    text = new_text
        turn = Turn(len(ids), 0, 0, "abort")  # stopped before its first step
        if output is not None:
            completion = output.outputs[0]
            reason = "abort" if stopped else completion.finish_reason
            turn = Turn(len(ids), output.num_cached_tokens, len(completion.token_ids), reason)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def stats_lines(self) -> list[str]:
        """What `/stats` prints: the conversation's size, the KV pool, prefix-cache reuse."""
        stats = self.engine.stats()
        block_size = stats["block_size"]
        tokens = max(len(self.prompt_token_ids()) - 1, 0) if self.messages else 0
        lines = [
            f"conversation  {len(self.turns)} turns, about {tokens} tokens "
            f"({-(-tokens // block_size)} KV blocks of {block_size} tokens)",
            f"KV pool       {stats['num_blocks']} blocks: {stats['num_used_blocks']} in use, "
            f"{stats.get('num_cached_blocks', 0)} cached for reuse, "
            f"{stats['num_free_blocks']} free or evictable",
        ]
        if self.turns:
            last = self.turns[-1]
            lines.append(
                f"last turn     {last.num_prompt_tokens} prompt tokens, "
                f"{last.num_cached_tokens} from the prefix cache "
                f"({last.num_cached_tokens / max(last.num_prompt_tokens, 1):.0%}); "
                f"{last.num_generated_tokens} generated ({last.finish_reason})"
            )
        lines.append(
            f"prefix cache  {stats.get('prefix_cache_hits', 0)} of "
            f"{stats.get('prefix_cache_queries', 0)} prompt tokens reused since start"
        )
        return lines


class _StopOnInterrupt:
    """While entered, Ctrl-C sets a flag instead of raising, so the engine is never
    interrupted in the middle of a step."""

    def __enter__(self) -> _StopOnInterrupt:
        self.hit = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.hit = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


def register(subparsers: Any) -> None:
    """Add `chat` to the `pagedkv` command."""
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="An interactive multi-turn chat through the model's chat template, "
        f"replies streamed. {_HELP}; Ctrl-C stops a reply.",
    )
    parser.add_argument("--system", default=None, help="a system message heading the chat")
    parser.add_argument("--max-tokens", type=int, default=512, help="per reply at most")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--top-p", type=float, default=0.9)
    EngineArgs.add_cli_args(parser, model_required=False)
    # One conversation: the pool is sized for one sequence of the model's context.
    parser.set_defaults(handler=run_chat, max_num_seqs=1)


def run_chat(args: argparse.Namespace) -> int:
    """Load the model and chat until /exit or end of input."""
    kernel_cache.announce()  # before torch loads, so the line comes at once
    from pagedkv.cli.demo import DEMO_EXTRA_HINT, find_demo_model
    from pagedkv.engine.engine import LLMEngine

    if args.model is None:  # the demo's chat model, when installed
        args.model = find_demo_model()
        if args.model is None:
            raise ValueError(
                f"--model: expected a model directory or .gguf file, got none "
                f"(or {DEMO_EXTRA_HINT} for a small chat model)"
            )
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args, model=str(args.model)))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    session = ChatSession(engine, params, system=args.system)
    print(f"pagedkv chat: {args.model}. {_HELP}; Ctrl-C stops a reply.", flush=True)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            continue
        if line in ("/exit", "/quit"):
            break
        _run_line(session, line)
    return _check_released(engine)


def _run_line(session: ChatSession, line: str) -> None:
    """Act on one input line: a /command, or a message to reply to."""
    if line == "/reset":
        session.reset()
        print("(conversation cleared)")
    elif line == "/stats":
        print("\n".join(session.stats_lines()))
    elif line == "/help":
        print(_HELP)
    elif line.startswith("/"):
        print(f"unknown command {line!r}: {_HELP}")
    elif line:
        with _StopOnInterrupt() as interrupt:
            try:
                session.reply(line, _write, should_stop=lambda: interrupt.hit)
            except ValueError as exc:
                print(f"error: {exc}")
        print(" [stopped]" if interrupt.hit else "", flush=True)


def _write(text: str) -> None:
    print(text, end="", flush=True)


def _check_released(engine: Any) -> int:
    """Every request ended, every block back in the pool: 0, else 1 with a message."""
    engine.kv_manager.check()
    used = engine.stats()["num_used_blocks"]
    if used or engine.has_unfinished_requests():
        print(f"error: {used} KV blocks still held at exit", file=sys.stderr)
        return 1
    return 0
