"""Per-request generation parameters, shaped like vLLM's (standard library only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv.engine.structured.params import StructuredOutputsParams

# Below this a temperature is treated as greedy: dividing logits by it would overflow.
_GREEDY_EPS = 1e-5
# Seeds are 64-bit integers, signed or not (torch.Generator.manual_seed's range).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# OpenAI's range for `logit_bias` values.
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    Attributes:
        n: completions per prompt; the prompt is prefilled once and its blocks forked.
        max_tokens: new tokens per completion at most.
        temperature: 0 is greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p.
        top_k: keep the k most likely tokens; -1 keeps all.
        min_p: drop tokens whose probability is below min_p x the top probability.
        seed: seeds each completion's generator from (seed, index): reproducible whatever
            else shares the batch. None draws a seed from the engine's seeded stream.
        stop: strings that end a completion (the text is cut before them).
        stop_token_ids: token ids that end a completion (kept in `token_ids`).
        ignore_eos: keep generating past the model's EOS token.
        logprobs: per generated token, return the logprobs of this many top tokens plus
            the sampled one; None returns none.
        prompt_logprobs: per prompt token after the first, return the logprobs of this many
            top tokens plus the prompt token; None returns none. Such a request takes no
            prefix-cache hits: a cached block has no logits, so its prompt is computed in full.
        logit_bias: token id -> value in [-100, 100] added to that token's logit before
            sampling (greedy included); logprobs stay those of the raw logits.
        structured_outputs: a constraint (JSON schema, regex, choice, grammar) the
            completions follow; None leaves them free.
        cache_salt: a non-empty string that enters the key of the prompt's first KV block:
            the request shares cached prefix blocks only with requests of the same salt, so
            one tenant's prompts never hit (nor time) another's. None shares with every
            unsalted request.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == 0:
            raise ValueError("top_k: expected -1 (disabled) or >= 1, got 0")
        for name, low, high in (
            ("temperature", 0.0, None),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}: expected a number, got {value!r}")
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                bound = f"a finite number >= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"{name}: expected {bound}, got {value!r}")
        if self.top_p <= 0.0:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=SEED_MIN)
            if self.seed > SEED_MAX:
                raise ValueError(f"seed: expected <= {SEED_MAX} (64 bits), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: expected non-empty strings, got {self.stop!r}")
        self.stop_strings = stop
        _check_structured(self.structured_outputs)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError(
                f"cache_salt: expected a non-empty string, got {self.cache_salt!r:.60}"
            )
        if self.stop_token_ids is not None:
            for token in self.stop_token_ids:
                _check_int("stop_token_ids", token, minimum=0)
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass
class BeamSearchParams:
    """Beam search: keep the `beam_width` best continuations by cumulative logprob.

    The final ranking divides the cumulative logprob by `length ** length_penalty`.
    With `structured_outputs`, every beam follows the constraint: its candidates are the
    tokens the grammar allows there (logprobs of the raw logits), and a beam ends where the
    grammar ends, even with `ignore_eos`.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        value = self.length_penalty
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"length_penalty: expected a number, got {value!r}")
        _check_structured(self.structured_outputs)


def _check_structured(value: object) -> None:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError(
            f"structured_outputs: expected StructuredOutputsParams, got {type(value).__name__}"
        )


def _check_logit_bias(logit_bias: object) -> dict[int, float]:
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias: expected a dict of token id -> bias, got {logit_bias!r:.60}")
    checked: dict[int, float] = {}
    for token, bias in logit_bias.items():
        _check_int("logit_bias token id", token, minimum=0)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias[{token}]: expected a number, got {bias!r:.40}")
        if abs(bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{token}]: expected in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {bias}"
            )
        checked[token] = float(bias)
    return checked


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
