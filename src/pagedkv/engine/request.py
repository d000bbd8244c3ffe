"""A request and its sequences: the scheduler's bookkeeping (standard library only).

A request holds one sequence per sample. With `n > 1` only sequence 0 exists until the
prompt is prefilled; the scheduler then forks its blocks to sequences 1..n-1.

Token layout of one sequence::

    token_ids:   | prompt ............ | output ......... |
                 0               prompt_len          len(token_ids)
    num_computed: tokens whose KV is in the cache (the manager's `num_tokens`); the
    tokens in [num_computed, len) are computed by the next steps, and the step that
    computes the last one samples a new token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

SeqId = tuple[str, int]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its blocks in the host pool
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """One sample of a request: its tokens and where its KV stands."""

    seq_id: SeqId
    token_ids: list[int]
    prompt_len: int
    num_computed: int = 0
    is_allocated: bool = False  # holds device blocks in the manager
    is_swapped: bool = False  # holds host blocks in the manager
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # `text` grows in `Scheduler.update` through the engine's detokenizer (stop strings are
    # matched on it); the logprobs are filled by the engine.
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    detokenizer: Any = None

    @property
    def index(self) -> int:
        return self.seq_id[1]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_decode(self) -> bool:
        """True when the next step computes exactly its newest token (a decode step)."""
        # Spelled out (no nested properties): the scheduler asks once per sequence per step.
        num_tokens = len(self.token_ids)
        return (
            self.is_allocated
            and num_tokens > self.prompt_len
            and num_tokens - self.num_computed == 1
        )


class Request:
    """One prompt with its sampling parameters and its sequences."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "n", "arrival_index",
                 "seed", "status", "metrics", "seqs", "stop_bounds", "prompt_logprobs",
                 "grammar")  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float,
        arrival_index: int,
        prompt: str | None = None,
        seed: int = 0,
    ) -> None:
        """A new request with only sample 0 (forked to the others after its prompt).

        Args:
            request_id: unique among live requests.
            prompt_token_ids: at least one token id.
            params: the sampling parameters (`params.n` sequences in the end).
            arrival_time: when it arrived (metrics only).
            arrival_index: the engine's arrival counter; orders requests fairly.
            prompt: the prompt text, when given as text.
            seed: the seed of its generators (`params.seed`, or one the engine drew).
        """
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.n = params.n  # samples (sequences once forked)
        self.arrival_index = arrival_index
        self.seed = seed
        self.status = RequestStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.seqs: list[Sequence] = [
            Sequence((request_id, 0), list(prompt_token_ids), len(prompt_token_ids))
        ]
        # Set by `Scheduler.add_request` (`pagedkv.engine.stop.stop_bounds`): which tokens
        # and length may end a sample; None: ask `check_stop` on every token.
        self.stop_bounds: tuple[frozenset[int], int] | None = None
        # Filled by the engine when asked: entry i holds prompt token i's logprobs (see
        # `RequestOutput.prompt_logprobs`); the first token has none.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        # A constrained request's `GrammarState` (`pagedkv.engine.structured.state`), set
        # by the engine once its grammar compiled: one matcher per sample, beside the
        # sequences whose tokens it follows.
        self.grammar: Any = None

    @property
    def is_forked(self) -> bool:
        return len(self.seqs) == self.n

    def seq(self, index: int) -> Sequence:
        """The sequence of sample `index`: ``seqs[index]``, since the fork appends samples
        1..n-1 in order after sample 0 (KeyError if none)."""
        if not 0 <= index < len(self.seqs):
            raise KeyError(f"request {self.request_id!r} has no sequence {index}")
        return self.seqs[index]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def num_unfinished_target(self) -> int:
        """Sequences this request will run at once: n before the fork, live ones after."""
        return len(self.unfinished_seqs()) if self.is_forked else self.n

    @property
    def is_finished(self) -> bool:
        # Before the fork only sequence 0 exists; if it ends there (abort, or no room to
        # grow), the request ends with it.
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's cumulative output now."""
        has_logprobs = self.params.logprobs is not None
        completions = [
            CompletionOutput(
                seq.index,
                seq.text,
                list(seq.output_token_ids),
                seq.cumulative_logprob if has_logprobs else None,
                list(seq.logprobs) if has_logprobs else None,
                seq.finish_reason,
                seq.stop_reason,
            )
            for seq in self.seqs
        ]
        for index in range(len(completions), self.n):
            # Ended before the prompt was forked (aborted early): empty samples.
            completions.append(
                CompletionOutput(index, "", [], 0.0, None, self.seqs[0].finish_reason)
            )
        prompt_logprobs = list(self.prompt_logprobs) if self.prompt_logprobs is not None else None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.is_finished,
            self.metrics,
            prompt_logprobs=prompt_logprobs,
        )

    def add_prompt_logprobs(self, start: int, rows: list[dict[int, float]]) -> None:
        """Place the rows of positions start.. as entries start+1.. (row p predicts token
        p+1). A recomputed prompt (after a preemption) brings rows already placed: they are
        skipped."""
        entries = self.prompt_logprobs
        assert entries is not None, "rows only for requests that asked for prompt logprobs"
        assert start + 1 <= len(entries), f"prompt logprobs from {start + 1}, have {len(entries)}"
        entries.extend(rows[len(entries) - (start + 1) :])

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"prompt_len={len(self.prompt_token_ids)}, seqs={len(self.seqs)}/{self.n})"
        )


def check_fits(
    request: Request, *, max_model_len: int, num_blocks: int, block_size: int, max_num_seqs: int
) -> None:
    """Raise ValueError unless `request` can ever run: a prompt of at least one token with
    room for one new token within `max_model_len` and the pool, and n <= `max_num_seqs`."""
    prompt_len = len(request.prompt_token_ids)
    if prompt_len == 0:
        raise ValueError("expected a prompt of at least one token, got an empty prompt")
    if prompt_len + 1 > max_model_len:
        raise ValueError(
            f"expected prompt + 1 token <= max_model_len "
            f"({max_model_len}), got {prompt_len} prompt tokens"
        )
    blocks = -(-(prompt_len + 1) // block_size)
    if blocks > num_blocks:
        raise ValueError(
            f"expected a prompt that fits the pool with one new token "
            f"({num_blocks} blocks of {block_size} tokens), got "
            f"{prompt_len} prompt tokens needing {blocks} blocks"
        )
    if request.n > max_num_seqs:
        raise ValueError(f"expected n <= max_num_seqs ({max_num_seqs}), got n={request.n}")
