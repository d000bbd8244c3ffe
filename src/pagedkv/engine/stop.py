"""When a sample ends: every stop condition decided in one place (standard library only).

`Scheduler.update` appends each sampled token, extends the sample's text with the newest
token's text (the detokenizer's output enters there, through the `detokenize` callable the
scheduler is built with; without one the text stays "" and stop strings never match), then
calls `check_stop` and finishes the sample on its answer. Precedence, first match wins:

    EOS (unless ignore_eos)  >  a stop token id  >  a stop string  >  max_tokens / max_model_len

so a stop string found on the token that also reaches `max_tokens` ends with "stop", as in
vLLM. Ends decided elsewhere are not stop conditions: an abort, and a request whose next
chunk can never fit the pool (the scheduler ends it with "length").
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.request import Sequence
from pagedkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Stop:
    """Why a sample ends: `reason`, and the stop string or stop token id (None for EOS
    and length)."""

    reason: FinishReason
    stop_reason: int | str | None = None


def check_stop(
    seq: Sequence,
    params: SamplingParams,
    *,
    eos_token_ids: Set[int],
    max_model_len: int,
    text_start: int,
) -> Stop | None:
    """Decide whether `seq` ends on its newest token; cut its text before a stop string.

    Args:
        seq: the sample, its newest token appended and `seq.text` extended by its text.
        max_model_len: longest sequence (prompt + output) the model accepts.
        text_start: `len(seq.text)` before the newest token's text was added.

    Returns:
        The stop, or None when the sample goes on.
    """
    token = seq.token_ids[-1]
    if not params.ignore_eos and token in eos_token_ids:
        return Stop("stop")
    if params.stop_token_ids and token in params.stop_token_ids:
        return Stop("stop", token)
    if params.stop_strings:
        hit = _find_stop_string(seq.text, params.stop_strings, text_start)
        if hit is not None:
            index, stop = hit
            seq.text = seq.text[:index]
            return Stop("stop", stop)
    if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return Stop("length")
    return None


def stop_bounds(
    params: SamplingParams, *, eos_token_ids: Set[int], max_model_len: int, prompt_len: int
) -> tuple[frozenset[int], int] | None:
    """What lets a caller skip `check_stop` for a token that cannot end the sample.

    Returns:
        ``(token_ids, max_len)``: `check_stop` returns None for a newest token not in
        `token_ids` when the sample holds fewer than `max_len` tokens. None when stop
        strings are set (the text must be searched): always call `check_stop` then.
    """
    if params.stop_strings:
        return None
    token_ids = frozenset(params.stop_token_ids or ())
    if not params.ignore_eos:
        token_ids |= eos_token_ids
    return token_ids, min(prompt_len + params.max_tokens, max_model_len)


def _find_stop_string(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after `start` (index, string)."""
    # A stop string may straddle the previous text; search from just before it.
    hits = [(text.find(stop, max(0, start - len(stop) + 1)), stop) for stop in stops]
    return min(((index, stop) for index, stop in hits if index >= 0), default=None)
