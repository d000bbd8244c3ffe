"""Compiles constraints into xgrammar grammars, off the engine's step loop.

One `GrammarCompiler` per engine, built from the tokenizer's vocabulary sized to the
model's logits (a padded LM head's extra ids are never allowed). Compiles run in a small
thread pool; each distinct constraint (`StructuredOutputsParams.key`) compiles once and
every request that carries it shares the future.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from pagedkv.engine.structured.params import StructuredOutputsParams

# xgrammar prefixes its errors with a time and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# `json_object`: any JSON object, as OpenAI's `{"type": "json_object"}` promises.
_ANY_OBJECT = '{"type": "object"}'
_LOOSE_CHARS = r"[^\"\\\r\n]"
_BASIC_CHARS = r"[^\0-\x1f\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\\ud800-\udfff]"
_NOUNS = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "EBNF grammar",
    "json_object": "JSON grammar",
}


def create_tokenizer_info(
    backend: Any, *, vocab_size: int, stop_token_ids: Iterable[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer` (`backend`) for a model whose logits
    have `vocab_size` columns.

    Special added tokens are left without text, so a grammar never spells them out; the
    stop tokens are the only special tokens a grammar allows, and only where it may end.
    """
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    encoded = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=sorted(stop_token_ids),
        add_prefix_space=metadata["add_prefix_space"],
    )


class StructuredOutputCompiler:
    """Compiled grammars by constraint, compiled in background threads and cached."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, max_workers: int = 2) -> None:
        self.tokenizer_info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pagedkv-grammar")
        self._futures: dict[tuple[str, str], Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer_info.vocab_size)

    @property
    def num_grammars(self) -> int:
        """Distinct constraints compiled or compiling."""
        return len(self._futures)

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compile of `params`' constraint: started now, or the one already started.

        A failed compile's future raises ValueError naming the field and the error; it
        stays cached, so the same bad constraint fails at once.
        """
        with self._lock:
            future = self._futures.get(params.key)
            if future is None:
                future = self._futures[params.key] = self._pool.submit(self._compile, params.key)
            return future

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """`submit(params).result()`: waits for the compile.

        Raises:
            ValueError: the constraint does not compile.
        """
        return self.submit(params).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        kind, text = key
        try:
            if kind == "json":
                return self._compiler.compile_grammar(json_schema_grammar(text))
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "grammar":
                return self._compiler.compile_grammar(text)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(text))
            return self._compiler.compile_grammar(json_schema_grammar(_ANY_OBJECT))
        except RuntimeError as exc:
            message = _LOCATION.sub("", str(exc).strip())
            raise ValueError(
                f"structured_outputs.{kind}: invalid {_NOUNS[kind]}: {message}"
            ) from None


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of a JSON schema (compact separators), with its string characters
    held to what JSON and UTF-8 allow.

    xgrammar's strings with a length bound take any character but quote, backslash and line
    breaks: raw control characters (invalid JSON) and UTF-16 surrogates (invalid UTF-8, and
    each then decodes to three replacement characters, past the bound).
    """
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    for loose in (_LOOSE_CHARS, _BASIC_CHARS):
        text = text.replace(loose, _JSON_CHARS)
    return text


def choice_grammar(choices_json: str) -> str:
    """An EBNF grammar whose language is exactly the strings of a JSON list (`key` text).

    JSON string escapes are EBNF string escapes; non-ASCII characters stay as they are (an
    escaped character beyond U+FFFF would be two surrogates, which EBNF reads as two).
    """
    choices = json.loads(choices_json)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
