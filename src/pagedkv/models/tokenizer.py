"""Tokenizer from a Hugging Face model directory, chat templates, streaming detokenization.

Uses the `tokenizers` library on `tokenizer.json`; `tokenizer_config.json` (or a
`chat_template.jinja` file, as transformers >= 4.43 saves it) supplies the special tokens and
the chat template. No transformers needed. Standard library + tokenizers (+ jinja2 for chat).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Attributes:
        eos_token_id, bos_token_id: ids of the eos/bos tokens, None when undeclared.
        vocab_size: number of ids the tokenizer can produce (added tokens included).
        chat_template: the jinja2 template string, or None.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; special tokens are given by their text."""
        self._tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from a dir.

        Raises:
            ValueError: no tokenizer.json, or a file that does not parse.
        """
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir}: expected tokenizer.json, found none")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise ValueError(f"{path}: not a valid tokenizer file ({exc})") from None
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
        return cls(
            tokenizer,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=_read_chat_template(model_dir, config),
        )

    @property
    def backend(self) -> Any:
        """The wrapped `tokenizers.Tokenizer` (its vocabulary, for grammar compilers)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (incomplete UTF-8 at the ends shows as U+FFFD)."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template;
        `tools` (OpenAI function tools) are passed to it as `tools`, as transformers does.

        Same jinja2 environment as transformers (trim_blocks, lstrip_blocks, `tojson`,
        `raise_exception`, `strftime_now`), sandboxed.

        Raises:
            ValueError: the tokenizer has no chat template, `messages` is malformed, or the
                template raises.
        """
        if self.chat_template is None:
            raise ValueError(
                "apply_chat_template: expected a tokenizer with a chat template, "
                "got none (no 'chat_template' in tokenizer_config.json)"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"messages: expected a list of dicts, got {type(messages).__name__}")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, indent=indent, ensure_ascii=False
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from None

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """`messages` as an engine prompt: {"prompt": `apply_chat_template`'s text,
        "prompt_token_ids": its ids}, encoded without special tokens (the template spells
        them out, BOS included).

        Raises:
            ValueError: as `apply_chat_template`.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time, for streaming.

    Decodes only a short window: `tokens[prefix_offset:]` minus `tokens[prefix_offset:
    read_offset]` is the new text. A window that ends in U+FFFD (half a multi-byte
    character) yields "" until the next token completes it. Starting the window a few
    tokens back keeps decoders that depend on context (leading-space rules) consistent.

        tokens:  ... | prefix_offset ... | read_offset ... | newest
                       already emitted      not yet emitted
    """

    _CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - self._CONTEXT_TOKENS, 0)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" if none yet)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta
