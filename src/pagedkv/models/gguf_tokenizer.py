"""The tokenizer and chat template a GGUF file carries in its metadata.

A GGUF has no `tokenizer.json`: llama.cpp stores the vocabulary, merges, token types and
special ids under `tokenizer.ggml.*`. transformers' GGUF support (the maintained converter)
turns those into a `tokenizers.Tokenizer`; this module calls it, then sets what the converter
leaves to transformers' wrapper classes, which pagedkv does not use: whether BOS/EOS are added
(`tokenizer.ggml.add_bos_token`), and the pre-tokenizer split of the few vocabularies the
converter does not know (llama.cpp's `tokenizer.ggml.pre`).

The result is saved as a `tokenizer.json` in pagedkv's cache (`gguf-tokenizers/`), keyed by
the file (path, size, modification time), this module and the versions of pagedkv,
transformers and tokenizers: later starts read it back and never import transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

from pagedkv.gguf_file import GGUF_INSTALL_HINT, GGUFFile
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.runtime import kernel_cache


def _converter() -> tuple[Any, dict[str, str]]:
    """transformers' `convert_gguf_tokenizer` and its metadata key -> field map, found
    where either major version keeps them.

    Raises:
        ImportError: transformers is missing or has no GGUF tokenizer converter.
    """
    try:
        from transformers.integrations.gguf import (  # transformers >= 5
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        try:
            # transformers 4.45 .. 4.x
            from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:
            raise ImportError(
                f"reading a GGUF file's tokenizer needs transformers (>= 4.45): {GGUF_INSTALL_HINT}"
            ) from None
    return convert_gguf_tokenizer, GGUF_TOKENIZER_MAPPING["tokenizer"]


def _post_processor(tokens: list[str], bos_id: int | None, eos_id: int | None) -> Any:
    """`[BOS] $A [EOS]` with whichever of the two the file asks to add."""
    from tokenizers import processors

    special = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    first = [tokens[bos_id]] if bos_id is not None else []
    last = [tokens[eos_id]] if eos_id is not None else []
    return processors.TemplateProcessing(
        single=" ".join([*first, "$A", *last]),
        pair=" ".join([*first, "$A", *last, *first, "$B:1", *last]),
        special_tokens=list(dict.fromkeys(special)),
    )


def load_gguf_tokenizer(file: GGUFFile) -> Tokenizer | None:
    """The tokenizer of a GGUF file, or None when it stores no vocabulary.

    Raises:
        ImportError: transformers is missing.
        ValueError: a tokenizer type the converter does not support (named).
    """
    meta = file.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    from tokenizers import Tokenizer as Backend

    saved = _saved_path(file)
    try:
        tokenizer = Backend.from_str(saved.read_text(encoding="utf-8"))
    except Exception:  # none saved (OSError), or a file that does not parse (tokenizers' own)
        tokenizer = _convert(file, tokens, bos_id, eos_id)
        try:
            kernel_cache.write_whole(saved, tokenizer.to_str().encode())
        except OSError:
            pass  # a read-only cache: the next start converts again, nothing else
    return Tokenizer(
        tokenizer,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _convert(file: GGUFFile, tokens: list[str], bos_id: int | None, eos_id: int | None) -> Any:
    """The file's `tokenizers.Tokenizer`, built by transformers' converter and completed
    (raises as `load_gguf_tokenizer`)."""
    from tokenizers import pre_tokenizers

    meta = file.metadata
    convert, mapping = _converter()
    fields = {
        name: meta[f"tokenizer.{key}"]
        for key, name in mapping.items()
        if f"tokenizer.{key}" in meta
    }
    tokenizer_type = meta.get("tokenizer.ggml.model")
    try:
        tokenizer, _ = convert(meta.get("general.architecture"), fields)
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise ValueError(
            f"{file.path}: cannot build tokenizer type {tokenizer_type!r} "
            f"(pre-tokenizer {meta.get('tokenizer.ggml.pre')!r}): {exc}"
        ) from None
    if tokenizer_type == "gpt2" and meta.get("tokenizer.ggml.pre") == "smollm":
        # SmolLM's split (its tokenizer.json): digits one by one, then the converter's GPT-2 one.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", tokenizer_type == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    tokenizer.post_processor = _post_processor(
        tokens, bos_id if add_bos else None, eos_id if add_eos else None
    )
    return tokenizer


def _saved_path(file: GGUFFile) -> Path:
    """Where the converted tokenizer of `file` is saved (it may not exist)."""
    stat = file.path.stat()
    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(f"{file.path.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode())
    for package in ("pagedkv", "transformers", "tokenizers"):
        try:
            key.update(f" {package} {importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            key.update(f" {package} none".encode())
    return kernel_cache.cache_root() / "gguf-tokenizers" / f"{key.hexdigest()[:24]}.json"
